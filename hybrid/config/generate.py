"""``python -m hybrid.config.generate``: write the generated flat flags,
``hybrid/config/flag_fields.py``, from the fields that declare them
(:func:`hybrid.config.flag_sources.render`); ``--check``: exit 1 where the file differs.
tests/config/test_single_definition.py runs the check."""

from __future__ import annotations

import sys

from hybrid.config.flag_sources import DECLARATIONS, GENERATED, render


def main(argv: list[str]) -> int:
    text = render()
    if "--check" in argv:
        return int(GENERATED.read_text() != text)
    GENERATED.write_text(text)
    print(f"wrote {GENERATED} ({len(DECLARATIONS)} flags)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
