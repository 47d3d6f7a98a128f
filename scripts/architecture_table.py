"""The README's supported-architecture table, generated from the test matrix (tests/test_architectures.py, the
tiny models of tests/conftest.py and the GGUF architectures of tests/gguf_files.py): every row is a family a test
compiles and compares with transformers token for token; the features column is what the test checks the compiled
artifact's spec shows.

    .venv/bin/python scripts/architecture_table.py            # print the table
    .venv/bin/python scripts/architecture_table.py --update   # rewrite it in README.md, between the markers
    .venv/bin/python scripts/architecture_table.py --check    # exit 1 when README.md's table is not this one
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BEGIN, END = "<!-- architecture-table:begin -->", "<!-- architecture-table:end -->"


def rows() -> dict[str, dict]:
    """transformers model type → {"class", "hf", "gguf", "features", "also"}."""
    import transformers

    sys.path.insert(0, str(ROOT))
    from tests.conftest import tiny_config
    from tests.gguf_files import TINY_CONFIGS
    from tests.test_architectures import ARCHITECTURES, GGUF_ARCHITECTURES

    from fxllm.compiler.model_features import causal_lm_class_name

    table: dict[str, dict] = {}

    def row(config) -> dict:
        return table.setdefault(config.model_type, {"class": causal_lm_class_name(config), "hf": "", "gguf": "",
                                                    "features": "", "also": ""})

    for name in ("llama", "qwen2", "mistral", "gpt2"):
        row(tiny_config(name))["hf"] = "✓"
    for entry in ARCHITECTURES.values():
        target = row(getattr(transformers, entry.config_class)())
        target.update(hf="✓", features=", ".join(entry.features), also=entry.also)
    for arch in GGUF_ARCHITECTURES:
        row(getattr(transformers, TINY_CONFIGS[arch][0])())["gguf"] = f"✓ ({arch})"
    return dict(sorted(table.items(), key=lambda item: item[1]["class"]))


def markdown() -> str:
    lines = ["| architecture | Hugging Face directory | GGUF file | features checked | also exercised |",
             "| --- | :---: | :---: | --- | --- |"]
    lines += [f"| `{r['class']}` | {r['hf']} | {r['gguf']} | {r['features']} | {r['also']} |" for r in rows().values()]
    return "\n".join(lines)


def readme_table(readme: str) -> str:
    start, stop = readme.index(BEGIN) + len(BEGIN), readme.index(END)
    return readme[start:stop].strip()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--update", action="store_true", help="rewrite the table in README.md")
    parser.add_argument("--check", action="store_true", help="exit 1 when README.md's table differs")
    args = parser.parse_args()
    table = markdown()
    readme_path = ROOT / "README.md"
    readme = readme_path.read_text()
    if args.update:
        start, stop = readme.index(BEGIN) + len(BEGIN), readme.index(END)
        readme_path.write_text(readme[:start] + "\n" + table + "\n" + readme[stop:])
    elif args.check:
        if readme_table(readme) != table:
            print("README.md's architecture table is not the matrix's; run scripts/architecture_table.py --update",
                  file=sys.stderr)
            return 1
    else:
        print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
