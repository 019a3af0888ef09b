"""Worker side of :func:`hora.run`: ``python -m hora.runner.run_task DIR``.

``DIR`` holds ``sys_path.json`` (the caller's ``sys.path``, so functions
pickled by reference import the same modules) and ``task.pkl`` (the
cloudpickled ``(fn, args, kwargs)``).  This rank writes
``DIR/result.<rank>.pkl``: ``("ok", value)`` or ``("error", exception,
formatted_traceback)``.  A raising function also prints its traceback to
stderr and exits with code 1, so the launcher stops the other ranks and the
traceback shows up in the root-cause report.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from typing import Any

from hora import envvars

TASK_FILE = "task.pkl"
PATH_FILE = "sys_path.json"


def result_file(directory: str, rank: int) -> str:
    """Where rank ``rank`` stores its outcome."""
    return os.path.join(directory, f"result.{rank}.pkl")


def _write(path: str, outcome: tuple[Any, ...]) -> None:
    import cloudpickle

    tmp = f"{path}.tmp"
    with open(tmp, "wb") as f:
        cloudpickle.dump(outcome, f)
    os.replace(tmp, path)  # the caller never sees a half-written result


def _picklable_error(error: BaseException, formatted: str) -> BaseException:
    import cloudpickle

    try:
        cloudpickle.loads(cloudpickle.dumps(error))
        return error
    except Exception:
        return RuntimeError(f"{type(error).__name__}: {error} (the exception could not be pickled)\n{formatted}")


def _rank() -> int:
    # Not hora.core.topology: importing hora.core would start the whole engine stack.
    if os.environ.get(envvars.HORA_RANK, "").isdigit():
        return int(os.environ[envvars.HORA_RANK])
    from hora.runner.mpi_child import rank_from_env

    return rank_from_env(os.environ)


def main(argv: list[str] | None = None) -> int:
    """Run the task in ``argv[0]`` as this rank and store the outcome."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m hora.runner.run_task DIR", file=sys.stderr)
        return 2
    directory = args[0]
    with open(os.path.join(directory, PATH_FILE), encoding="utf-8") as f:
        for entry in reversed(json.load(f)):
            if entry not in sys.path:
                sys.path.insert(0, entry)

    import cloudpickle

    rank = _rank()
    try:
        with open(os.path.join(directory, TASK_FILE), "rb") as f:
            fn, fn_args, fn_kwargs = cloudpickle.load(f)
        value = fn(*fn_args, **fn_kwargs)
    except BaseException as error:  # SystemExit / KeyboardInterrupt from fn are failures too
        formatted = traceback.format_exc()
        sys.stderr.write(formatted)
        _write(result_file(directory, rank), ("error", _picklable_error(error, formatted), formatted))
        return 1
    try:
        _write(result_file(directory, rank), ("ok", value))
    except Exception as error:
        formatted = traceback.format_exc()
        sys.stderr.write(f"hora.run: the return value of rank {rank} cannot be pickled\n{formatted}")
        _write(result_file(directory, rank), ("error", _picklable_error(error, formatted), formatted))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
