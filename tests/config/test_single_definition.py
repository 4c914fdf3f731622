"""Each option is defined once: a flag's ``to=`` is the only mapping into its section.

What these tests hold, so the property cannot rot: every route names a real section
field and agrees with it on type and default; every section field gets its value from
one flag or from one derivation in build.py, never silently from its default; every
flag is read by something; the ds_config key table names only real flags; and the
context-parallel comm types are written in one place.
"""

import ast
import dataclasses
import pathlib
import re

import pytest

import hybrid.config.build as build_module
from hybrid.config import Flags, build_config
from hybrid.config.architecture import ARCHITECTURE_FIELDS
from hybrid.config.build import SECTION_TYPES
from hybrid.config.deepspeed_keys import KEYS, Flag
from hybrid.config.flags import ROUTES
from hybrid.config.model import ModelConfig
from hybrid.config.sections import CP_COMM_TYPES

ROOT = pathlib.Path(__file__).resolve().parents[2]
CLI_FIELDS = [f for f in dataclasses.fields(Flags) if f.metadata.get("cli") is not False]
FLAG_FIELDS = {f.name: f for f in dataclasses.fields(Flags)}
# A flag that sets nothing, on purpose: Megatron-DeepSpeed's switch to DeepSpeed's
# activation checkpointing, which hybrid's ZeRO-R always is (its --help says so).
NO_EFFECT = {"deepspeed_activation_checkpointing"}
# Sections built by their own constructors rather than cut from routes: the model reads
# its routes itself (ModelConfig.from_flags also reads a checkpoint's saved flags); the
# tokenizer and the kernels derive every field (canonical type names; the environment).
OWN_CONSTRUCTOR = {"model", "tokenizer", "kernels"}


def _routes():
    return [(section, field, flag) for section, fields in ROUTES.items()
            for field, flag in fields.items()]


def _shape(annotation: str) -> tuple[str, bool]:
    """(the type without None, whether None is allowed); a list or a tuple of one element
    type as "seq[elem]" (a list flag reaches its frozen section as a tuple)."""
    parts = [p.strip() for p in annotation.split("|")]
    (base,) = [p for p in parts if p != "None"]
    seq = re.fullmatch(r"(?:list|tuple)\[(\w+)(?:, (?:\1|\.\.\.))*\]", base)
    return (f"seq[{seq.group(1)}]" if seq else base), "None" in parts


@pytest.fixture(scope="module")
def filled() -> Flags:
    """The default flags once the checks have filled their derived defaults."""
    return build_config(Flags(), 1).flags


@pytest.mark.parametrize("section,field,flag", _routes())
def test_a_route_names_a_section_field_of_the_same_type_and_default(section, field, flag,
                                                                     filled):
    """A flag and the field it fills may not disagree. Where the flag's default is None
    and the section's is not, the checks must fill the flag (--global-batch-size: micro x
    DP), so a built section never holds the None its own type or default rules out."""
    assert section in SECTION_TYPES, f"Flags.{flag}: to={section!r} is not a TrainConfig section"
    target = {f.name: f for f in dataclasses.fields(SECTION_TYPES[section])}
    assert field in target, f"Flags.{flag}: {section} has no field {field!r}"
    ours, theirs = FLAG_FIELDS[flag], target[field]
    (kind, none_ok), (section_kind, section_none_ok) = _shape(ours.type), _shape(theirs.type)
    assert kind == section_kind, f"Flags.{flag} is {ours.type}, {section}.{field} {theirs.type}"
    default = ours.default if not isinstance(ours.default, list) else tuple(ours.default) or None
    if (none_ok and not section_none_ok) or default != theirs.default:
        assert default is None and getattr(filled, flag) is not None, (
            f"Flags.{flag} defaults to {default!r}, {section}.{field} to {theirs.default!r}, "
            f"and no check fills the flag")
    else:
        assert none_ok == section_none_ok, f"Flags.{flag} is {ours.type}, {section}.{field} " \
                                           f"{theirs.type}"


def test_every_section_field_has_one_source(monkeypatch):
    """Every section is cut by build.py's _section from its routes, or built by its own
    constructor; _section refuses a field with no source or two, so a full build proves
    each cut section whole. Routing to a section nothing cuts would be ignored: refused."""
    cut = []
    real = build_module._section
    monkeypatch.setattr(build_module, "_section",
                        lambda f, name, **derived: cut.append(name) or real(f, name, **derived))
    for flags in (Flags(), Flags(zero_stage=3, offload_optimizer="nvme", offload_param="nvme",
                                 offload_nvme_path="/tmp/x", recompute_granularity="full",
                                 train_samples=1000, data_path=["a"])):
        build_config(flags, 2)
    assert not set(cut) & OWN_CONSTRUCTOR and set(cut) | OWN_CONSTRUCTOR == set(SECTION_TYPES)
    assert set(ROUTES) <= set(cut) | {"model"}, "a flag routes to a section nothing cuts by route"
    # the model section: routed fields, the architecture (from the Llama-family flags, with a
    # saved checkpoint's defaults), two widths with fallbacks, the tokenizer's vocabulary
    own = [*ROUTES["model"], *ARCHITECTURE_FIELDS, "ffn_hidden_size",
           "max_position_embeddings", "vocab_size"]
    assert sorted(own) == sorted(f.name for f in dataclasses.fields(ModelConfig))


def test_a_field_left_without_its_flag_fails_the_build(monkeypatch):
    """The check above can fail: drop --offload-gds's route and no config builds."""
    monkeypatch.delitem(ROUTES["offload"], "gds")
    with pytest.raises(TypeError, match=r"section offload: no flag is routed to \['gds'\]"):
        build_config(Flags(), 1)


def test_every_flag_is_read():
    """A flag not routed to a section is read by the code that derives fields or checks
    them (a flag nothing reads would be accepted and do nothing)."""
    readers = "\n".join((ROOT / "hybrid" / "config" / name).read_text()
                        for name in ("build.py", "checks.py", "model.py", "architecture.py"))
    routed = {flag for *_, flag in _routes()}
    unread = [f.name for f in CLI_FIELDS if f.name not in routed | NO_EFFECT
              and not re.search(rf"(\.{f.name}\b|[\"']{f.name}[\"'])", readers)]
    assert not unread, f"flags nothing maps or reads: {unread}"


def test_the_ds_config_keys_name_flags():
    """A key sets a flag's field and so reaches the flag's section; a Flag rule naming no
    flag is refused when the table is built."""
    assert all(rule.field in FLAG_FIELDS for rule in KEYS.values() if isinstance(rule, Flag))
    with pytest.raises(TypeError, match="Flags has no field 'offload_gpu_direct'"):
        Flag("offload_gpu_direct")


def test_the_cp_comm_types_are_written_once():
    """hybrid.config.sections holds them; the check, the attention layer and the estimator
    import them."""
    from hybrid.config import checks
    assert checks.CP_COMM_TYPES is CP_COMM_TYPES
    literal = set(CP_COMM_TYPES)
    where = []
    for path in sorted((ROOT / "hybrid").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel == "hybrid/config/sections.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(), rel)):
            if (isinstance(node, ast.Tuple) and len(node.elts) == len(literal)
                    and {getattr(e, "value", None) for e in node.elts} == literal):
                where.append(f"{rel}:{node.lineno}")
    assert not where, f"the CP comm types written again: {where}"
    tree = ast.parse((ROOT / "hybrid/tensor_parallel/cp_attention.py").read_text())
    assert any(isinstance(n, ast.ImportFrom) and n.module == "hybrid.config.sections"
               and "CP_COMM_TYPES" in [a.name for a in n.names] for n in ast.walk(tree))
