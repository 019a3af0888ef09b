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

/* A kernel's clip::Map(x, bound), bound >= 0 (a NaN passes through, as with NumPy's clip). */
static inline float clip_to(float x, float bound) {
    return x > bound ? bound : (x < -bound ? -bound : x);
}

/* Adam's and LAMB's moments, as hora.kvstore.optimizer.base.moments: m = m * b1 + g * b1c and
 * v = v * b2 + (g * b2c) * g. */
static inline void moments(float g, float *restrict m, float *restrict v, float b1, float b1c, float b2,
                           float b2c) {
    float mi = *m * b1;
    float s = g * b1c;
    mi = mi + s;
    float vi = *v * b2;
    s = g * b2c;
    s = s * g;
    vi = vi + s;
    *m = mi;
    *v = vi;
}

/* Adam (hora.kvstore.optimizer.adaptive.Adam, MXNet's adam_update):
 * g = clip(grad * rescale + w * decay); m = m * b1 + g * b1c; v = v * b2 + (g * b2c) * g;
 * w = w - (m * lr) / (sqrt(v) + eps). */
HORA_CLONES void hora_adam_f32(float *restrict w, const float *restrict grad, float *restrict m,
                               float *restrict v, long n, float rescale, float decay, int clip, float bound,
                               float b1, float b1c, float b2, float b2c, float lr, float eps) {
    for (long i = 0; i < n; i++) {
        float g = grad[i] * rescale;
        float t = w[i] * decay;
        g = g + t;
        if (clip) {
            g = clip_to(g, bound);
        }
        moments(g, &m[i], &v[i], b1, b1c, b2, b2c);
        float step = m[i] * lr;
        float den = sqrtf(v[i]);
        den = den + eps;
        step = step / den;
        w[i] = w[i] - step;
    }
}

/* AdaGrad's dense rule (hora.kvstore.optimizer.adaptive.AdaGrad, no clipping): g = grad * rescale;
 * h = h + g * g; w = w + (g / sqrt(h + eps) + w * decay) * neg_lr. */
HORA_CLONES void hora_adagrad_f32(float *restrict w, const float *restrict grad, float *restrict h, long n,
                                  float rescale, float eps, float decay, float neg_lr) {
    for (long i = 0; i < n; i++) {
        float g = grad[i] * rescale;
        float t = g * g;
        float hi = h[i] + t;
        h[i] = hi;
        t = hi + eps;
        t = sqrtf(t);
        g = g / t;
        t = w[i] * decay;
        g = g + t;
        g = g * neg_lr;
        w[i] = w[i] + g;
    }
}

/* MXNet's multi_sum_sq of one float32 array: sum += x[i] * x[i] in float, in order. */
HORA_CLONES float hora_sum_sq_f32(const float *restrict x, long n) {
    float sum = 0.0f;
    for (long i = 0; i < n; i++) {
        float sq = x[i] * x[i];
        sum = sum + sq;
    }
    return sum;
}

/* LAMB's direction (hora.kvstore.optimizer.lamb.LAMB, MXNet's multi_lamb_update) on float32 arrays:
 * r = clip(grad * rescale); m = m * b1 + r * b1c; v = v * b2 + (r * b2c) * r; with bias correction
 * r = m / den_mean and t = v / den_var (else m and v);
 * out = (float)((double)r / (sqrt((double)t) + eps) + (double)(w * wd)), the kernel's double sqrt. */
HORA_CLONES void hora_lamb_direction_f32(const float *restrict w, const float *restrict grad, float *restrict m,
                                         float *restrict v, float *restrict out, long n, float rescale, int clip,
                                         float bound, float b1, float b1c, float b2, float b2c, int bias_correction,
                                         float den_mean, float den_var, double eps, float wd) {
    for (long i = 0; i < n; i++) {
        float r = grad[i] * rescale;
        if (clip) {
            r = clip_to(r, bound);
        }
        moments(r, &m[i], &v[i], b1, b1c, b2, b2c);
        float t = v[i];
        if (bias_correction) {
            r = m[i] / den_mean;
            t = v[i] / den_var;
        } else {
            r = m[i];
        }
        double q = sqrt((double)t);
        q = q + eps;
        double d = (double)r / q;
        float decay = w[i] * wd;
        d = d + (double)decay;
        out[i] = (float)d;
    }
}
