"""The sampler-settings table (dgemma_engine.settings): its one range check, and that one new row is all the
Modelfile parser, the API options, the REPL's `/set parameter` and `dgemma show` need to know about a setting."""
from __future__ import annotations

import io
import math
from dataclasses import dataclass, fields

import pytest

from cli_helpers import cli_env, in_process
from dgemma_cli.modelfile import ModelfileError, check_parameter_ranges, parse_modelfile
from dgemma_cli.server import options as server_options
from dgemma_cli.server.errors import RequestError
from dgemma_engine import settings
from dgemma_engine.settings import Limits, SamplerParams, SamplerSetting, SettingError, check_values
from store_helpers import write_tiny_gguf

RELEASED = settings.released_defaults()


def checked(reference: bool = False, cap: int | None = 256, **changes) -> str | None:
    """The error text of check_values for the released values with `changes`, None when they pass."""
    try:
        check_values({**RELEASED, **changes}, max_steps_cap=cap, reference=reference)
    except SettingError as exc:
        return str(exc)
    return None


# ---- the table itself ---------------------------------------------------------------------------------------------

def test_every_row_is_a_sampler_params_field_with_the_rows_default():
    by_name = {f.name: f for f in fields(SamplerParams)}
    for s in settings.SAMPLER_SETTINGS:
        assert by_name[s.field].default == s.default and isinstance(s.default, s.type), s.field
        # the entropy-bound sampler's own settings; num_canvases (the seeds' option name), self_cond_top_k (the
        # engine's) and task_tries (the server's task layer) are in no file format
        if s.field in ("num_canvases", "self_cond_top_k", "task_tries"):
            assert s.gguf_key is None and s.hf_key is None and s not in settings.FILE_SETTINGS
        else:
            assert s.option.startswith("diffusion_") and s.gguf_key.startswith("diffusion.eb_"), s.field
    assert len({s.option for s in settings.SAMPLER_SETTINGS}) == len(settings.SAMPLER_SETTINGS)


def test_released_defaults_and_gguf_defaults():
    assert RELEASED == {"max_steps": 48, "t_max": 0.8, "t_min": 0.4, "entropy_bound": 0.1,
                        "confidence_threshold": 0.005, "stability_threshold": 1, "num_canvases": 1,
                        "self_cond_top_k": 0, "task_tries": 1}
    got = settings.defaults_from_metadata({"diffusion.eb_max_steps": 12.0, "diffusion.eb_t_min": True,
                                           "diffusion.eb_t_max": "hot"})
    assert got == {**RELEASED, "max_steps": 12}  # a bool or a string is no number: the released value stays
    assert isinstance(got["max_steps"], int)


def test_options_from_fields_keeps_table_order_and_drops_unset():
    assert settings.options_from_fields({"stability_threshold": 2, "max_steps": 7, "t_min": None}) == \
        {"diffusion_steps": 7, "diffusion_stability_threshold": 2}
    with pytest.raises(KeyError):
        settings.options_from_fields({"temperature": 1.0})


# ---- the one validator --------------------------------------------------------------------------------------------

def test_released_values_pass_both_ranges():
    assert checked() is None and checked(reference=True) is None


@pytest.mark.parametrize("changes, message", [
    ({"max_steps": 0}, "invalid value for diffusion_steps: 0 (must be between 1 and 256)"),
    ({"max_steps": 257}, "invalid value for diffusion_steps: 257 (must be between 1 and 256)"),
    ({"t_min": -0.1}, "invalid value for diffusion_t_min: -0.1 (must be at least 0)"),
    ({"t_min": -1.0}, "invalid value for diffusion_t_min: -1 (must be at least 0)"),
    ({"t_min": 0.9, "t_max": 0.1}, "invalid value for diffusion_t_max: 0.1 (must be at least diffusion_t_min (0.9))"),
    ({"entropy_bound": 0.0}, "invalid value for diffusion_entropy_bound: 0 (must be greater than 0)"),
    ({"confidence_threshold": -0.5}, "invalid value for diffusion_confidence_threshold: -0.5 (must be greater than 0)"),
    ({"stability_threshold": 0}, "invalid value for diffusion_stability_threshold: 0 (must be at least 1)"),
])
def test_each_bound_in_the_servers_wording(changes, message):
    assert checked(**changes) == message


def test_the_relation_allows_equality_and_the_edges_pass():
    assert checked(t_min=0.0, t_max=0.0) is None  # temperature 0: argmax at every step
    assert checked(max_steps=1) is None and checked(max_steps=256) is None and checked(stability_threshold=1) is None
    assert checked(cap=None, max_steps=10_000) is None  # no cap given: no upper bound


def test_first_error_follows_the_servers_order():
    """t_min's own bound is checked before t_max is compared with it, and both before the later rows."""
    assert "diffusion_t_min" in checked(t_min=-1.0, t_max=-2.0)
    assert "diffusion_t_max" in checked(t_min=0.9, t_max=0.1, entropy_bound=0.0)
    assert "diffusion_steps" in checked(max_steps=0, stability_threshold=0)


def test_absent_settings_are_not_checked_and_an_absent_bound_is_its_lowest_value():
    check_values({"t_max": 0.1})  # t_min unknown: at least its own lower bound 0
    with pytest.raises(SettingError, match=r"^invalid value for diffusion_t_max: -0.1 \(must be at least 0\)$"):
        check_values({"t_max": -0.1})
    check_values({})


def test_reference_ranges_are_transformers():
    assert checked(reference=True, stability_threshold=0) is None
    assert checked(reference=True, stability_threshold=-1) == \
        "invalid value for diffusion_stability_threshold: -1 (must be at least 0)"
    assert checked(reference=True, t_min=0.5, t_max=0.5) == \
        "invalid value for diffusion_t_max: 0.5 (must be greater than diffusion_t_min (0.5))"
    assert checked(reference=True, cap=None, max_steps=0) == "invalid value for diffusion_steps: 0 (must be at least 1)"


def test_callers_raise_their_own_error_type():
    with pytest.raises(RequestError, match=r"diffusion_t_max: 0.1 \(must be at least diffusion_t_min \(0.9\)\)"):
        server_options.resolve_sampler({"diffusion_t_min": 0.9, "diffusion_t_max": 0.1}, {}, 256)
    with pytest.raises(ModelfileError, match=r"^invalid value for diffusion_t_max: 0.1 \(must be at least"):
        check_parameter_ranges({"diffusion_t_min": 0.9, "diffusion_t_max": 0.1})


def test_a_relation_is_checked_against_the_model_s_own_default():
    def decode(options, metadata):
        return server_options.decode_options({}, options, metadata, 4096, 256)

    assert decode({"diffusion_t_min": 5.0}, {"diffusion.eb_t_max": 10.0}).sampler.t_min == 5.0
    with pytest.raises(RequestError, match=r"diffusion_t_max: 0\.8 \(must be at least diffusion_t_min \(5"):
        decode({"diffusion_t_min": 5.0}, {})  # the released t_max
    with pytest.raises(RequestError, match="diffusion_t_max"):
        decode({"diffusion_t_min": 0.9, "diffusion_t_max": 0.1}, {"diffusion.eb_t_max": 10.0})
    assert math.isinf(server_options.resolve_sampler({"diffusion_t_max": math.inf}, {}, 256).t_max)


def test_options_are_decoded_once_into_one_record():
    decoded = server_options.decode_options({"num_ctx": 2048, "temperature": 0.5, "num_gpu": 3},
                                            {"temperature": 0.7, "num_predict": 20, "unknown": 1}, {}, 4096, 256)
    assert (decoded.num_ctx, decoded.placement) == (2048, {"num_gpu": 3})
    assert (decoded.sampler.num_predict, decoded.sampler.max_steps) == (20, 48)
    assert server_options.decode_options(None, None, {"diffusion.eb_max_steps": 12}, 4096, 256).sampler.max_steps == 12
    assert server_options.decode_options(None, None, {}, 4096, 256).num_ctx == 4096
    with pytest.raises(RequestError, match=r"^invalid value for num_ctx: 0 \(must be between 1 and 1048576\)$"):
        server_options.decode_options(None, {"num_ctx": 0}, {}, 4096, 256)


# ---- one new row reaches every front end --------------------------------------------------------------------------

FAKE = SamplerSetting("warmup_steps", "diffusion_warmup_steps", "diffusion.eb_warmup_steps", "warmup_steps", int, 1,
                      "warmup steps", "Steps sampled at t_max first", Limits(1))


@dataclass(frozen=True)
class SettingsWithWarmup(server_options.SamplerSettings):
    """The engine's half of adding a setting: the field the sampler would read."""

    warmup_steps: int = 1


@pytest.fixture
def fake_row(monkeypatch):
    monkeypatch.setattr(settings, "SAMPLER_SETTINGS", settings.SAMPLER_SETTINGS + (FAKE,))
    monkeypatch.setattr(server_options, "SamplerSettings", SettingsWithWarmup)


def test_a_new_row_is_a_modelfile_parameter(fake_row):
    assert parse_modelfile("FROM m\nPARAMETER diffusion_warmup_steps 3\n").parameters == {"diffusion_warmup_steps": 3}
    with pytest.raises(ModelfileError, match=r"invalid int value \[many\]"):
        parse_modelfile("FROM m\nPARAMETER diffusion_warmup_steps many\n")
    with pytest.raises(ModelfileError, match=r"^invalid value for diffusion_warmup_steps: 0 \(must be at least 1\)$"):
        check_parameter_ranges({"diffusion_warmup_steps": 0})


def test_a_new_row_is_an_api_option(fake_row):
    assert server_options.check_options({"diffusion_warmup_steps": 2.0}) == {"diffusion_warmup_steps": 2}
    with pytest.raises(RequestError, match='option "diffusion_warmup_steps" must be of type integer'):
        server_options.check_options({"diffusion_warmup_steps": "2"})
    resolved = server_options.resolve_sampler({"diffusion_warmup_steps": 4}, {}, 256)
    assert resolved.warmup_steps == 4 and resolved.max_steps == 48
    assert server_options.resolve_sampler({}, {"diffusion.eb_warmup_steps": 2}, 256).warmup_steps == 2
    with pytest.raises(RequestError, match=r"^invalid value for diffusion_warmup_steps: 0 \(must be at least 1\)$"):
        server_options.resolve_sampler({"diffusion_warmup_steps": 0}, {}, 256)


def test_a_new_row_is_a_repl_parameter(fake_row, monkeypatch):
    from dgemma_cli.cmd_run import RunSettings
    from dgemma_cli.repl import Repl

    monkeypatch.setenv("DGEMMA_NOHISTORY", "1")
    out = io.StringIO()
    repl = Repl(None, RunSettings(model="tiny"), {}, out=out)
    repl.set_parameter([])
    listing = [line for line in out.getvalue().splitlines() if "diffusion_warmup_steps" in line]
    assert len(listing) == 1 and listing[0].startswith("  /set parameter diffusion_warmup_steps <int>    ")
    assert listing[0].endswith("    Steps sampled at t_max first")
    repl.set_parameter(["diffusion_warmup_steps", "2"])
    repl.set_parameter(["diffusion_warmup_steps", "two"])
    assert out.getvalue().splitlines()[-2:] == ["Set parameter 'diffusion_warmup_steps' to '2'",
                                                "Couldn't set parameter: \"invalid int value [two]\""]
    assert repl.settings.options == {"diffusion_warmup_steps": 2}


def test_a_new_row_is_created_and_shown(fake_row, tmp_path):
    env = cli_env(tmp_path)  # nothing listens: the commands serve the API in-process, with the patched table
    write_tiny_gguf(tmp_path / "tiny.gguf")
    (tmp_path / "Modelfile").write_text("FROM ./tiny.gguf\nPARAMETER diffusion_warmup_steps 3\n")
    code, _, err = in_process(env, "create", "warmup", "-f", str(tmp_path / "Modelfile"))
    assert code == 0, err
    code, out, _ = in_process(env, "show", "warmup")
    assert code == 0 and "    warmup steps            3\n" in out
    assert in_process(env, "show", "warmup", "--parameters") == (0, f"{'diffusion_warmup_steps':<30} 3\n", "")
    (tmp_path / "Modelfile").write_text("FROM ./tiny.gguf\nPARAMETER diffusion_warmup_steps 0\n")
    code, _, err = in_process(env, "create", "bad", "-f", str(tmp_path / "Modelfile"))
    assert code == 1 and err.endswith("Error: invalid value for diffusion_warmup_steps: 0 (must be at least 1)\n")


def test_nan_and_infinite_values_are_out_of_range_and_stored_ones_fall_back_to_the_defaults():
    """A NaN passes every `<` test, so it is refused by name; a GGUF written before create checked its sampler keys
    falls back to the released defaults rather than failing every request."""
    with pytest.raises(settings.SettingError, match="diffusion_entropy_bound"):
        settings.check_values({"entropy_bound": math.nan})
    defaults = settings.defaults_from_metadata({"diffusion.eb_max_steps": math.nan, "diffusion.eb_t_max": math.inf})
    assert defaults["max_steps"] == 48 and defaults["t_max"] == 0.8
