"""hybrid's test suite, a package: each test module imports as ``tests.<folder>.<module>``.

[Note: why the tests are packages]
pytest puts a test file's folder on ``sys.path`` unless the folder is a package, and a
folder on ``sys.path`` is importable under its own name. A folder named like a real
package (``tests/deepspeed/`` once was) then imports as that package wherever the real
one is not installed: ``pytest.importorskip("deepspeed")`` found the test folder and the
test failed instead of skipping. With an ``__init__.py`` in every folder only the
checkout's root is on ``sys.path`` (``pythonpath`` in pyproject.toml), and
``tests/test_layout.py`` fails when a folder lacks one or shares its name with a package a
test imports.
"""
