"""The model-family registry (docs/model_families.md): every folder under `families/` is a family with every part
registered, found without a line elsewhere, and no code outside a family's folder branches on which family it is.

Oracles: the folder names, the recipe's `model.arch` choices, the model presets, and the source read with `ast`.
"""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from megatron_scalerl import families
from megatron_scalerl.families import FAMILIES, hf_config_dict, hf_family, layer_plan
from megatron_scalerl.families.spec import FamilySpec, LayerPlan
from megatron_scalerl.recipe import ModelConfig, load_recipe, model_config_from_hf, model_preset_names

PACKAGE = Path(families.__file__).resolve().parents[1]
FAMILY_DIR = Path(families.__file__).resolve().parent


def _presets() -> dict[str, list[ModelConfig]]:
    """{arch: the model presets of that family}."""
    found: dict[str, list[ModelConfig]] = {}
    for name in model_preset_names():
        model = load_recipe("scalerl", model_preset=name).model
        found.setdefault(model.arch, []).append(model)
    return found


def test_every_family_folder_is_registered_under_its_name():
    folders = sorted(p.name for p in FAMILY_DIR.iterdir() if (p / "__init__.py").is_file())
    assert list(FAMILIES) == folders == list(families.NAMES)
    assert all(isinstance(spec, FamilySpec) and spec.name == name for name, spec in FAMILIES.items())
    assert ModelConfig.model_fields["arch"].annotation.__args__ == families.NAMES  # the recipe's choices
    model_types = [spec.hf_model_type for spec in FAMILIES.values()]
    assert len(set(model_types)) == len(model_types)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_every_family_has_all_its_parts(name):
    """The pure side's fields, the torch side's `PARTS`, and a model preset whose HF config goes both ways."""
    from megatron_scalerl.models.family import ModelParts, model_parts  # megatron-core: the torch side

    spec = FAMILIES[name]
    presets = _presets().get(name)
    assert presets, f"family {name} has no model preset in megatron_scalerl/recipes/models/"
    for model in presets:
        parts = model_parts(model)
        assert isinstance(parts, ModelParts) and parts.mapping.attention and parts.mapping.dense_mlp
        assert bool(parts.mapping.moe_mlp) == spec.moe
        config = hf_config_dict(model)
        assert hf_family(config) is spec and config["architectures"] == [spec.hf_architecture]
        assert model_config_from_hf(config) == model
        plans = [layer_plan(model, i) for i in range(model.num_layers)]
        assert all(isinstance(plan, LayerPlan) for plan in plans)
        assert any(plan.moe for plan in plans) == model.is_moe


def test_a_new_folder_is_a_new_family(tmp_path, monkeypatch):
    """Discovery: a folder with a FAMILY joins the registry, with no line added anywhere else."""
    toy = tmp_path / "toy"
    toy.mkdir()
    (toy / "__init__.py").write_text(textwrap.dedent("""
        from megatron_scalerl.families import FAMILIES
        FAMILY = FAMILIES["llama3"]
    """))
    monkeypatch.setattr(families, "__path__", [*families.__path__, str(tmp_path)])
    try:
        assert list(families._discover()) == sorted([*FAMILIES, "toy"])
    finally:
        sys.modules.pop(f"{families.__name__}.toy", None)


THROWAWAY_FAMILY = """
from pydantic import Field

from megatron_scalerl.families.llama3 import FAMILY as LLAMA3
from megatron_scalerl.families.spec import FamilySpec
from megatron_scalerl.section import Pos, Section


class ToyFields(Section):
    toy_width: Pos = Field(7, description="toy: a width only this family reads (features)")


FAMILY = FamilySpec(name="toy", hf_architecture="ToyForCausalLM", hf_model_type="toy", moe=False,
                    layer=LLAMA3.layer, hf_fields=LLAMA3.hf_fields, model_fields=LLAMA3.model_fields,
                    fields=ToyFields)
"""
THROWAWAY_CHECK = """
import megatron_scalerl
from megatron_scalerl.errors import RecipeError
from megatron_scalerl.recipe import explain_key, load_recipe, preset_catalogue

assert megatron_scalerl.__file__.startswith(COPY), megatron_scalerl.__file__
toy = load_recipe("scalerl", ["model.arch=toy", "model.toy_width=9"], model_preset="tiny_dense")
assert toy.model.toy_width == 9 and load_recipe("scalerl", model_preset="tiny_dense").model.toy_width == 7
try:
    load_recipe("scalerl", ["model.toy_width=9"], model_preset="tiny_dense")
except RecipeError as exc:
    assert "toy_width is a setting of arch toy, not of llama3" in str(exc), exc
else:
    raise AssertionError("a llama3 model took toy_width")
print(explain_key("model.toy_width", preset_catalogue()).key.description)
"""


def test_a_family_with_a_field_of_its_own_touches_nothing_outside_its_folder(tmp_path):
    """A throwaway family, added to a copy of the package as one new folder, declares a field of its own: a recipe
    of it loads with the field, another family's model refuses it, and `recipe explain` describes it."""
    copy = tmp_path / "src"
    shutil.copytree(Path(families.__file__).parents[1], copy / "megatron_scalerl",
                    ignore=shutil.ignore_patterns("__pycache__"))
    folder = copy / "megatron_scalerl" / "families" / "toy"
    folder.mkdir()
    (folder / "__init__.py").write_text(THROWAWAY_FAMILY)
    result = subprocess.run([sys.executable, "-c", f"COPY = {str(copy)!r}\n" + THROWAWAY_CHECK],
                            env={**os.environ, "PYTHONPATH": str(copy)}, cwd=tmp_path, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "toy: a width only this family reads (features)"


def _family_values() -> set[str]:
    """The strings that name a family: its arch, HF model type and HF architecture."""
    return {v for spec in FAMILIES.values() for v in (spec.name, spec.hf_model_type, spec.hf_architecture)}


def _branches(tree: ast.AST, names: set[str]) -> list[tuple[int, str]]:
    """(line, what) of every comparison with `arch` or a family's name, and of every dict keyed by one."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            for side in (node.left, *node.comparators):
                if isinstance(side, ast.Name) and side.id == "arch" or isinstance(side, ast.Attribute) and \
                        side.attr == "arch":
                    found.append((node.lineno, "compares arch"))
                elif isinstance(side, ast.Constant) and side.value in names:
                    found.append((node.lineno, f"compares with {side.value!r}"))
        elif isinstance(node, ast.Dict):
            found += [(key.lineno, f"dict keyed by {key.value!r}") for key in node.keys
                      if isinstance(key, ast.Constant) and key.value in names]
    return found


def test_no_family_branches_outside_the_family_folders():
    names = _family_values()
    branches = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE)
        if relative.parts[0] == "families" and len(relative.parts) > 2:  # inside families/<name>/
            continue
        branches += [f"{relative}:{line}: {what}" for line, what in _branches(ast.parse(path.read_text()), names)]
    assert not branches, "family-specific branches outside families/<name>/:\n" + "\n".join(branches)


def test_the_branch_scan_sees_branches():
    code = 'if model_cfg.arch == "llama4": pass\nTABLE = {"llama3": 1}\nok = kind != "default"\n'
    assert [what for _, what in _branches(ast.parse(code), _family_values())] == [
        "compares arch", "compares with 'llama4'", "dict keyed by 'llama3'"]


def test_a_family_refuses_what_its_models_cannot_compute_when_the_recipe_loads():
    """Llama-4 routing scales the expert input by the router score, which top-1 routing alone computes as HF does."""
    from megatron_scalerl.errors import UserError

    with pytest.raises(UserError, match=r"moe_router_topk: Llama-4 routing .* only 1 \(arch llama4\)"):
        load_recipe("demo", ["model.moe_router_topk=2"])
    assert load_recipe("demo").model.moe_router_topk == 1


@pytest.mark.parametrize(("preset", "field", "value", "owner"), [
    ("tiny_qwen3", "use_qk_norm", True, "llama4"),
    ("tiny_qwen3_moe", "attention_chunk_size", 32, "llama4"),
    ("tiny_moe", "norm_topk_prob", False, "deepseek_v3 and qwen3_moe"),
    ("tiny_qwen3_moe", "kv_lora_rank", 512, "deepseek_v3"),
])
def test_another_familys_field_is_refused(preset, field, value, owner):
    """A family's own model-section fields (`FamilySpec.own_fields`) set on another family's model: refused, named."""
    section = load_recipe("scalerl", model_preset=preset).model.model_dump()
    with pytest.raises(ValueError, match=f"{field} is a setting of arch {owner}, not of {section['arch']}"):
        ModelConfig.model_validate({**section, field: value})
