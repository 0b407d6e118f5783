"""Run many ForgeTrain command lines cheaply: one process imports torch, Hydra and forgetrain once, then forks a
child per command line that runs the command's real entry point (what ``python -m <module>`` runs) with its own
argv, working directory, environment and stdout/stderr files, and exits the way the interpreter would: the
``SystemExit`` code, or a printed traceback and 1 for an escaping exception.

``python tests/cli_fork.py CASES.json RESULTS.json``; each case: ``{"id", "module", "argv", "cwd", "block": [module
names made unimportable, as when an optional extra is not installed]}``; each result: ``{"rc", "stdout", "stderr",
"seconds"}``. Linux only (fork).
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run as a script: the repo root
from tests.limits import hang_s  # noqa: E402

ENTRY = {"forgetrain": "forgetrain.cli", "forgetrain.verify": "forgetrain.verify", "forgetrain.bench": "forgetrain.bench"}


def _child(case: dict, out_path: str, err_path: str) -> int:
    os.chdir(case["cwd"])
    for fd, path in ((1, out_path), (2, err_path)):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(f, fd)
        os.close(f)
    for name in case.get("block", []):
        sys.modules[name] = None
    sys.argv = [case["module"], *case["argv"]]
    code = 0
    try:
        importlib.import_module(ENTRY[case["module"]]).main()
    except SystemExit as e:
        if e.code is None:
            code = 0
        elif isinstance(e.code, int):
            code = e.code
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:  # noqa: BLE001 - what the interpreter does with an escaping exception
        traceback.print_exc()
        code = 1
    try:
        import atexit

        atexit._run_exitfuncs()
    except BaseException:  # noqa: BLE001
        traceback.print_exc()
    sys.stdout.flush()
    sys.stderr.flush()
    return code


def run_cases(cases: list[dict], scratch: str, timeout_s: float | None = None) -> dict:
    """Run each case in a forked child; a child still running after ``timeout_s`` (default: tests/limits.py's
    hang limit, taken per case) is killed and its rc is ``"timeout"``."""
    results = {}
    for case in cases:
        out_path = os.path.join(scratch, f"{case['id']}.out")
        err_path = os.path.join(scratch, f"{case['id']}.err")
        t0, limit = time.time(), timeout_s or hang_s()
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                code = _child(case, out_path, err_path)
            finally:
                os._exit(code)
        rc = None
        while time.time() - t0 < limit:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                rc = os.waitstatus_to_exitcode(status)
                break
            time.sleep(0.02)
        if rc is None:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            rc = "timeout"
        results[case["id"]] = {"rc": rc, "stdout": open(out_path).read(), "stderr": open(err_path).read(),
                               "seconds": round(time.time() - t0, 2)}
    return results


def main() -> None:
    cases_path, results_path = sys.argv[1], sys.argv[2]
    cases = json.load(open(cases_path))
    import torch  # noqa: F401 - paid once, before the forks
    import hydra  # noqa: F401
    import forgetrain.bench  # noqa: F401
    import forgetrain.cli  # noqa: F401
    import forgetrain.train  # noqa: F401
    import forgetrain.verify  # noqa: F401

    scratch = os.path.dirname(os.path.abspath(results_path))
    json.dump(run_cases(cases, scratch), open(results_path, "w"), indent=1)


if __name__ == "__main__":
    main()
