"""``python -m forgetrain.kernels list|switches|validate|bench|seal [--kernel NAME] [--device cpu|cuda] [--shapes small|full]``

* ``list``      each kernel, its source hash, its seals per device (``STALE`` when the source changed since).
* ``switches``  every ``kernels.<op>=<value>`` switch, the tier each value declares, which need a seal.
* ``validate``  fwd + bwd against the fp64 oracle beside the replaced op; exit 1 when any kernel fails.
* ``bench``     CUDA-event timings vs the replaced op and torch.compile of it (skipped, exit 0, without CUDA).
* ``seal``      validate (+ bench on CUDA) and record the result in registry.json; refuses failing kernels.

Defaults: ``--device cuda`` when torch sees a GPU, else ``cpu`` (Triton interpreter); ``--shapes full`` on CUDA,
``small`` on CPU. ``--json PATH`` writes the full results (atomically).
"""

from __future__ import annotations

import argparse
import os
import sys


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m forgetrain.kernels", description=__doc__.split("\n\n")[0])
    p.add_argument("command", choices=("list", "switches", "validate", "bench", "seal"))
    p.add_argument("--kernel", action="append", help="kernel name (repeatable); default: all")
    p.add_argument("--device", choices=("cpu", "cuda"), default=None)
    p.add_argument("--shapes", choices=("small", "full"), default=None)
    p.add_argument("--seed", type=int, default=None, help="validation seed (default: fresh)")
    p.add_argument("--json", default=None, help="write full results to this JSON file")
    p.add_argument("--registry", default=None, help="registry path (default: forgetrain/kernels/registry.json)")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--rotate-mb", type=float, default=128.0)
    p.add_argument("--no-compile", action="store_true", help="bench: skip torch.compile of the replaced op")
    p.add_argument("--no-bench", action="store_true", help="seal: validation only, even on CUDA")
    return p


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "switches":  # needs neither torch nor triton
        from forgetrain.kernels.switches import table

        print("\n".join(table()))
        return 0
    if args.device == "cpu":
        # must precede the first import of triton (kernel modules import it lazily)
        os.environ["TRITON_INTERPRET"] = "1"
    import torch

    from forgetrain.errors import one_line_errors

    @one_line_errors
    def run() -> int:
        from forgetrain.extras import install_hint, require

        require("kernels", ("triton",), "python -m forgetrain.kernels")  # the optional extra: one line if absent
        try:
            return _run()
        except ImportError as e:  # a package the extra should have brought is missing or broken
            from forgetrain.errors import ConfigError

            raise ConfigError(f"python -m forgetrain.kernels: {str(e).splitlines()[0]}; reinstall the extra: "
                              f"{install_hint('kernels')}") from None

    def _run() -> int:
        from forgetrain import kernels
        from forgetrain.kernels.seal import list_lines
        from forgetrain.trace import atomic_write_json

        device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
        shapes = args.shapes or ("full" if device == "cuda" else "small")
        bench_shapes = "bench" if shapes == "full" else shapes  # the timed subset of the full grid
        names = args.kernel or list(kernels.KERNELS)
        specs = [kernels.get_spec(n) for n in names]
        if args.command == "list":
            print("\n".join(list_lines(specs, args.registry)))
            return 0
        results, rc = {}, 0

        def dump():
            if args.json:
                atomic_write_json(args.json, results)

        if args.command in ("validate", "seal"):
            from forgetrain.kernels.validate import format_report, validate
            from forgetrain.kernels.seal import seal
            for spec in specs:
                rep = validate(spec, device, shapes=shapes, seed=args.seed)
                print(format_report(rep), flush=True)
                results[spec.name] = {"validation": rep.to_dict()}
                rc |= 0 if rep.passed else 1
                if args.command == "seal":
                    if not rep.passed:
                        print(f"{spec.name}: not sealed (validation failed)", flush=True)
                        dump()
                        continue
                    bres = None
                    if device == "cuda" and not args.no_bench:
                        from forgetrain.kernels.bench import bench
                        def partial(r, name=spec.name):
                            results[name]["bench"] = r
                            dump()

                        bres = bench(spec, device, shapes=bench_shapes, repeats=args.repeats, warmup=args.warmup,
                                     rotate_bytes=args.rotate_mb * 1e6, compile_ref=not args.no_compile,
                                     on_case=partial)
                        results[spec.name]["bench"] = bres
                    entry = seal(spec, rep, bres, args.registry)
                    print(f"{spec.name}: sealed on {device} ({entry['source_sha256'][:12]})", flush=True)
                dump()
            return rc
        if args.command == "bench":
            from forgetrain.kernels.bench import BenchSkipped, bench
            try:
                for spec in specs:
                    def partial(r, name=spec.name):
                        results[name] = r
                        dump()

                    results[spec.name] = bench(spec, device, shapes=bench_shapes, repeats=args.repeats,
                                               warmup=args.warmup, rotate_bytes=args.rotate_mb * 1e6,
                                               compile_ref=not args.no_compile, on_case=partial)
                    dump()
            except BenchSkipped as e:
                print(str(e), flush=True)
                return 0
            return 0
        return 2

    return run()


if __name__ == "__main__":
    sys.exit(main())
