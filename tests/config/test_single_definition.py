"""Each option is declared once, on the field that takes it (:mod:`hybrid.config.options`),
and the flat Flags are generated from the declarations (:mod:`hybrid.config.flag_sources`).

What these tests hold, so the property cannot rot: the generated flag_fields.py is
current; every ``opt`` is on a class the generator reads, and no flag is declared twice;
--help groups flags by what takes them; every route names a real section
field and agrees with it on type and default; every section field gets its value from
one flag or from one derivation in build.py, never silently from its default; every
flag is read by something; the ds_config key table names only real flags; the
context-parallel comm types are written in one place; every constraint a field declares
(``opt(choices=, at_least=, above=, at_most=, below=)``) is enforced with the one message
naming the flag; and every ds_config key a field declares (``opt(ds=)``) sets that field.
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
from hybrid.config.checks import allowed
from hybrid.config.deepspeed import apply_ds_config
from hybrid.config.deepspeed_keys import KEYS, Flag, kind_of
from hybrid.config.flags import ROUTES, field_type, flag_name
from hybrid.config.model import ModelConfig
from hybrid.config.moe import MoEConfig
from hybrid.config.options import BOUNDS
from hybrid.config.sections import CP_COMM_TYPES
from hybrid.errors import ConfigError

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
           "max_position_embeddings", "vocab_size",
           "moe"]  # (the MoE section, from its own flags: hybrid/config/moe.py)
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
                        for name in ("build.py", "checks.py", "model.py", "architecture.py",
                                     "moe.py"))
    routed = {flag for *_, flag in _routes()}
    # MoEConfig.from_flags reads each of its fields by the field's own name
    routed |= {f.name for f in dataclasses.fields(MoEConfig)}
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
    """hybrid.config.sections holds them; the flag's closed set, the attention layer and the
    estimator import them."""
    field = {f.name: f for f in dataclasses.fields(Flags)}["cp_comm_type"]
    assert field.metadata["choices"] is CP_COMM_TYPES
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


# -- a field's own constraints and ds_config keys ------------------------------------------

def _outside(f: dataclasses.Field) -> list:
    """Values just outside what field ``f`` declares: past each bound, or beside its
    closed set (one past the largest of numbers; a name it lacks), and each refused one."""
    meta = f.metadata
    if "choices" in meta:
        choices = list(meta["choices"])
        beside = (max(choices) + 1 if all(isinstance(c, int) for c in choices)
                  else "not-" + str(choices[0]))
        return [beside, *meta.get("refused", {})]
    step = 1 if field_type(f)[0] is int else 0.5
    out = {"at_least": lambda b: b - step, "above": lambda b: b,
           "at_most": lambda b: b + step, "below": lambda b: b}
    return [out[b](meta[b]) for b in BOUNDS if b in meta]


CONSTRAINED = [(f.name, v) for f in CLI_FIELDS if allowed(f) is not None for v in _outside(f)]


def test_the_constraints_are_declared():
    """A sample of the fields whose single-option checks moved onto their declaration: the
    tests below cover what is declared, so a declaration dropped by mistake would only
    shrink them."""
    declared = {name for name, _ in CONSTRAINED}
    assert {"zero_stage", "cp_comm_type", "recompute_method", "adam_eps", "seed",
            "hidden_dropout", "offload_buffer_count", "eval_iters", "vocab_size"} <= declared


@pytest.mark.parametrize("name,value", CONSTRAINED)
def test_a_value_outside_a_declared_constraint_is_one_error_naming_the_flag(name, value):
    """check_fields enforces every choices=/bound on a field, with one message format:
    the flag, what it must be, the value given (and why, for a refused value)."""
    f = FLAG_FIELDS[name]
    with pytest.raises(ConfigError) as e:
        build_config(Flags(**{name: value}), 1)
    message = f"{flag_name(name)} must be {allowed(f)}, got {value!r}"
    why = f.metadata.get("refused", {}).get(value)
    assert str(e.value) == (message + f": {why}" if why else message)


@pytest.mark.parametrize("name", sorted({name for name, _ in CONSTRAINED}))
def test_a_value_on_a_bound_or_in_the_set_passes_the_field_check(name):
    """Inside: each value of the closed set, and an inclusive bound itself (check_fields
    alone: other checks may refuse a value for reasons of their own)."""
    from hybrid.config.checks import check_fields
    f = FLAG_FIELDS[name]
    inside = list(f.metadata.get("choices", ()))
    inside += [f.metadata[b] for b in ("at_least", "at_most") if b in f.metadata]
    for value in inside:
        check_fields(Flags(**{name: value}))


def _declared_keys():
    return [(f.name, key) for f in CLI_FIELDS for key in f.metadata["ds"]]


def test_the_flag_rules_are_the_keys_the_fields_declare():
    """Every Flag rule of the key table comes from one field's ds=, with its kind and
    conversion; none is written anywhere else."""
    declared = {key.path: (name, key) for name, key in _declared_keys()}
    rules = {path: rule for path, rule in KEYS.items() if isinstance(rule, Flag)}
    assert sorted(rules) == sorted(declared)
    for path, rule in rules.items():
        name, key = declared[path]
        assert (rule.field, rule.kind, rule.convert) == (name, key.kind, key.convert), path


def _a_value(kind, default):
    """A value of ``kind`` (the key's) that differs from the field's default."""
    if kind.base == "choice":
        return [c for c in kind.choices if c is not None][-1]
    return {"bool": not default, "int": 3, "number": 0.5, "string": "/tmp/x"}[kind.base]


@pytest.mark.parametrize("name,key", _declared_keys(), ids=lambda v: getattr(v, "path", v))
def test_a_declared_ds_key_sets_its_field(name, key):
    """The key, alone in a ds_config, sets its field (converted as declared) and the field
    is then named by the key."""
    value = _a_value(kind_of(KEYS[key.path]), FLAG_FIELDS[name].default)
    ds: dict = {}
    *sections, last = key.path.split(".")
    inner = ds
    for part in sections:
        inner = inner.setdefault(part, {})
    inner[last] = value
    # (the activation_checkpointing keys apply only with whole-layer recompute)
    f = Flags(recompute_granularity="full")
    apply_ds_config(f, ds, dp=1)
    expected = key.convert(value) if key.convert else value
    assert getattr(f, name) == expected
    assert f.given_as[name] == f"ds_config {key.path}"


# -- declared once, on the field that takes it; Flags generated ----------------------------

def test_the_generated_flags_are_current():
    """hybrid/config/flag_fields.py is what ``python -m hybrid.config.generate`` writes from
    the declarations today (a flag added, renamed or retyped without regenerating fails)."""
    from hybrid.config.flag_sources import GENERATED, render
    assert GENERATED.read_text() == render(), "run: python -m hybrid.config.generate"


def test_a_stale_generated_file_is_caught(monkeypatch):
    """The check above can fail: a declaration gone, the rendering differs from the file."""
    from hybrid.config import flag_sources
    monkeypatch.delitem(flag_sources.DECLARATIONS, "offload_gds")
    assert flag_sources.GENERATED.read_text() != flag_sources.render()


def test_every_opt_is_on_a_declaring_class():
    """Each ``opt(`` call in hybrid/config is a field of a class flag_sources.SOURCES lists
    (one declared elsewhere would never reach the command line), and each section source
    is the class TrainConfig holds under its name."""
    from hybrid.config.flag_sources import SOURCES
    listed = {s.cls.__name__ for s in SOURCES}
    stray = []
    for path in sorted((ROOT / "hybrid" / "config").glob("*.py")):
        tree = ast.parse(path.read_text())
        for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
            calls = [n for n in ast.walk(cls) if isinstance(n, ast.Call)
                     and getattr(n.func, "id", None) in ("opt", "route")]
            if calls and cls.name not in listed:
                stray.append(f"{path.name}:{cls.name}")
        top = [n for n in tree.body if not isinstance(n, ast.ClassDef)]
        stray += [f"{path.name}:{n.lineno}" for t in top for n in ast.walk(t)
                  if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "opt"]
    assert not stray, f"flags declared outside flag_sources.SOURCES: {stray}"
    for s in SOURCES:
        assert s.section is None or SECTION_TYPES[s.section] is s.cls, s


def test_a_flag_declared_twice_is_refused(monkeypatch):
    """Two fields declaring one flag would leave one silently unused: the table refuses."""
    from hybrid.config import flag_sources
    from hybrid.config.options import opt

    @dataclasses.dataclass(frozen=True)
    class Again:
        zero_stage: int = opt(0, "again")

    monkeypatch.setattr(flag_sources, "SOURCES", (*flag_sources.SOURCES,
                                                  flag_sources.Source("again", Again)))
    with pytest.raises(TypeError, match="--zero_stage is declared by ZeroConfig.stage and "
                                        "Again.zero_stage"):
        flag_sources._declarations()


def test_help_groups_flags_by_what_takes_them():
    """--help shows one group per section (the input classes join their section's), each
    flag under the group of the class that declares it."""
    from hybrid.config.flags import build_parser
    groups = {g.title: [a.dest for a in g._group_actions]
              for g in build_parser()._action_groups}
    assert groups["ZeRO data parallelism"][:2] == ["zero_stage", "reduce_bucket_size"]
    assert "use_distributed_optimizer" in groups["ZeRO data parallelism"]
    assert "offload_nvme_path" in groups["offload (ZeRO-Offload, ZeRO-Infinity)"]
    assert "lr_warmup_iters" in groups["learning rate"] and "lr" in groups["learning rate"]
    shown = sum((dests for title, dests in groups.items()
                 if title not in ("options", "positional arguments")), [])
    assert sorted(shown) == sorted(f.name for f in CLI_FIELDS)
