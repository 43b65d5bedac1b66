import pytest
import yaml
from pydantic import ValidationError

from narwhal_serve.config import NarwhalConfig, format_validation_error


def test_serve_config_runs_a_managed_simulated_fleet_on_loopback() -> None:
    doc = yaml.safe_load(open("serve_config.yaml"))
    app = doc["applications"][0]
    assert app["import_path"] == "deployments.app:build_app"
    assert doc["http_options"]["host"] == "127.0.0.1"
    cfg = NarwhalConfig.model_validate(app["args"])
    engines = cfg.resolved_engines()
    assert sorted(e.role for e in engines) == ["decode", "prefill", "unified"]
    for e in engines:  # launched and supervised by Narwhal, reachable on loopback only, no CPU reserved
        assert e.launch is not None and not e.url
        assert (e.launch.kind, e.launch.host, e.launch.resources.num_cpus) == ("sim", "127.0.0.1", 0)


def test_no_engines_is_the_embedded_fleet() -> None:
    cfg = NarwhalConfig.model_validate({})
    roles = [e.role for e in cfg.resolved_engines()]
    assert sorted(roles) == ["decode", "prefill", "unified"]
    assert all(e.url.startswith("http://127.0.0.1:") for e in cfg.resolved_engines())


@pytest.mark.parametrize("args,needle", [
    ({"serving": {"max_request_byte": 5}}, "unknown config key 'serving.max_request_byte'"),
    ({"bogus": 1}, "unknown config key 'bogus'"),
    ({"admission": {"mode": "fast"}}, "config key 'admission.mode'"),
    ({"engines": [{"name": "a", "url": "http://x", "role": "both"}]}, "config key 'engines.0.role'"),
    ({"admission": {"ttft_budget_s": 90, "max_ttft_budget_s": 60}}, "ttft_budget_s"),
])
def test_bad_config_names_the_key(args: dict, needle: str) -> None:  # type: ignore[type-arg]
    with pytest.raises(ValidationError) as exc:
        NarwhalConfig.model_validate(args)
    assert needle in format_validation_error(exc.value)


def test_configured_engines_replace_the_sim_fleet() -> None:
    cfg = NarwhalConfig.model_validate({"engines": [{"name": "v", "url": "http://127.0.0.1:9/", "dialect": "vllm"}]})
    assert [e.base_url for e in cfg.resolved_engines()] == ["http://127.0.0.1:9"]
