/* hora's fused float32 update loops (loaded by hora/kvstore/optimizer/fused.py).
 *
 * Each loop performs, per element, the operations of the NumPy rule it stands
 * for, in the same order, each rounded to float: fused.py builds this file
 * with -ffp-contract=off (no fused multiply-add) and without -ffast-math, and
 * checks the loop against the NumPy rule before using it.  One pass over the
 * arrays instead of one pass per operation is the whole gain.
 */
#include <math.h>
#include <stddef.h>

/* One portable library: on x86-64 the loader picks the widest vector unit the CPU has. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define HORA_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define HORA_CLONES
#endif

/* Adam (hora.kvstore.optimizer.adaptive.Adam, MXNet's adam_update):
 * g = clip(grad * rescale + w * decay); m = m * b1 + g * b1c; v = v * b2 + (g * b2c) * g;
 * w = w - (m * lr) / (sqrt(v) + eps). */
HORA_CLONES void hora_adam_f32(float *restrict w, const float *restrict grad, float *restrict m, float *restrict v, long n,
                   float rescale, float decay, int clip, float bound, float b1, float b1c, float b2, float b2c,
                   float lr, float eps) {
    for (long i = 0; i < n; i++) {
        float g = grad[i] * rescale;
        float t = w[i] * decay;
        g = g + t;
        if (clip) {
            g = g > bound ? bound : (g < -bound ? -bound : g);
        }
        float mi = m[i] * b1;
        t = g * b1c;
        mi = mi + t;
        float vi = v[i] * b2;
        t = g * b2c;
        t = t * g;
        vi = vi + t;
        m[i] = mi;
        v[i] = vi;
        float step = mi * lr;
        float den = sqrtf(vi);
        den = den + eps;
        step = step / den;
        w[i] = w[i] - step;
    }
}
