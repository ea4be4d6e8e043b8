"""List the flags of `vllm serve` from a vLLM wheel, without installing or importing vLLM.

    python tools/vllm_serve_flags.py vllm-0.26.0-cp38-abi3-manylinux_2_28_x86_64.whl > tests/data/vllm-0.26.0-serve-flags.txt

(`pip download vllm==0.26.0 --no-deps --only-binary=:all: --python-version 3.12 --platform
manylinux_2_28_x86_64` fetches the wheel.) Reads vllm/engine/arg_utils.py (every `add_argument("--...")`)
and vllm/entrypoints/openai/cli_args.py (its explicit flags and the fields of the FrontendArgs dataclasses,
which vLLM turns into `--field-name` flags). One flag per line: the long name, then its short aliases.
deepinfer_jax/server/vllm_flags.py must classify every one (tests/unit/server/test_vllm_flags.py checks).
"""

import ast
import sys
import zipfile


def calls(source: str):
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument":
            names = [a.value for a in node.args
                     if isinstance(a, ast.Constant) and isinstance(a.value, str) and a.value.startswith("-")]
            if names:
                yield names


def main(wheel: str) -> None:
    with zipfile.ZipFile(wheel) as z:
        engine = z.read("vllm/engine/arg_utils.py").decode()
        frontend = z.read("vllm/entrypoints/openai/cli_args.py").decode()
    flags: dict[str, list[str]] = {}
    for source in (engine, frontend):
        for names in calls(source):
            long = [n for n in names if n.startswith("--")]
            if long and "{" not in long[0]:
                flags.setdefault(long[0], names)
    for cls in ast.parse(frontend).body:
        if isinstance(cls, ast.ClassDef) and cls.name in ("BaseFrontendArgs", "FrontendArgs"):
            for st in cls.body:
                if isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name) and not st.target.id.startswith("_"):
                    flag = "--" + st.target.id.replace("_", "-")
                    flags.setdefault(flag, [flag])
    for flag in sorted(flags):
        print(" ".join(flags[flag]))


if __name__ == "__main__":
    main(sys.argv[1])
