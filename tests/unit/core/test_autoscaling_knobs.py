"""``deployment.*`` autoscaling knobs: validation, and the ``autoscaling_config`` handed to Serve."""

import warnings

import pytest
from pydantic import ValidationError

from narwhal_serve.config import DeploymentKnobs, NarwhalConfig, format_validation_error


def test_defaults_keep_the_previous_autoscaling() -> None:
    knobs = NarwhalConfig().deployment
    assert knobs.autoscaling("ingress") == {
        "min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 64.0, "upscale_delay_s": 30.0,
        "downscale_delay_s": 600.0, "look_back_period_s": 30.0, "metrics_interval_s": 10.0,
    }
    assert knobs.autoscaling("assembler") == knobs.autoscaling("ingress")


def test_each_deployment_gets_its_own_bounds_and_target() -> None:
    knobs = NarwhalConfig.model_validate({"deployment": {
        "ingress_min_replicas": 1, "ingress_max_replicas": 3, "ingress_target_ongoing_requests": 2,
        "assembler_min_replicas": 2, "assembler_max_replicas": 4, "assembler_target_ongoing_requests": 3.5,
        "upscale_delay_s": 2, "downscale_delay_s": 10, "look_back_period_s": 5, "metrics_interval_s": 1,
    }}).deployment
    ing, asm = knobs.autoscaling("ingress"), knobs.autoscaling("assembler")
    assert (ing["min_replicas"], ing["max_replicas"], ing["target_ongoing_requests"]) == (1, 3, 2.0)
    assert (asm["min_replicas"], asm["max_replicas"], asm["target_ongoing_requests"]) == (2, 4, 3.5)
    for conf in (ing, asm):
        assert (conf["upscale_delay_s"], conf["downscale_delay_s"]) == (2.0, 10.0)
        assert (conf["look_back_period_s"], conf["metrics_interval_s"]) == (5.0, 1.0)


@pytest.mark.parametrize("knobs,needle", [
    ({"ingress_min_replicas": 3, "ingress_max_replicas": 2}, "ingress_min_replicas (3) must not exceed"),
    ({"assembler_min_replicas": 3}, "assembler_min_replicas (3) must not exceed"),
    ({"ingress_target_ongoing_requests": 0}, "config key 'deployment.ingress_target_ongoing_requests'"),
    ({"assembler_target_ongoing_requests": -1}, "config key 'deployment.assembler_target_ongoing_requests'"),
    ({"upscale_delay_s": -1}, "config key 'deployment.upscale_delay_s'"),
    ({"downscale_delay_s": -0.5}, "config key 'deployment.downscale_delay_s'"),
    ({"look_back_period_s": 0}, "config key 'deployment.look_back_period_s'"),
    ({"metrics_interval_s": 0}, "config key 'deployment.metrics_interval_s'"),
    ({"look_back_period_s": 5, "metrics_interval_s": 5}, "look_back_period_s must exceed"),
    ({"target_ongoing_requests": 2}, "unknown config key 'deployment.target_ongoing_requests'"),
])
def test_bad_autoscaling_knobs_name_the_key(knobs: dict, needle: str) -> None:  # type: ignore[type-arg]
    with pytest.raises(ValidationError) as exc:
        NarwhalConfig.model_validate({"deployment": knobs})
    assert needle in format_validation_error(exc.value)


def test_serve_accepts_what_the_knobs_produce() -> None:
    """The dict is a valid Ray Serve AutoscalingConfig with the same values (no FutureWarning:
    look-back is checked against the metrics interval here first)."""
    serve_config = pytest.importorskip("ray.serve.config")
    knobs = DeploymentKnobs(ingress_max_replicas=3, ingress_target_ongoing_requests=2, upscale_delay_s=1,
                            downscale_delay_s=5, look_back_period_s=4, metrics_interval_s=1)
    for dep in ("ingress", "assembler"):
        conf = knobs.autoscaling(dep)
        with warnings.catch_warnings():
            warnings.simplefilter("error", FutureWarning)
            warnings.simplefilter("ignore", DeprecationWarning)  # Serve deprecates metrics_interval_s's name
            parsed = serve_config.AutoscalingConfig(**conf)
        assert {k: getattr(parsed, k) for k in conf} == conf
