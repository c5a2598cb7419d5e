"""Every shape field is bounded: values outside are ConfigErrors quoting them; skews at the bound generate."""

import itertools
import math

import pytest

from kvkit.errors import ConfigError
from kvkit.sim.synthetic import shape

OUTSIDE = {
    "rag@document_skew=60": "document_skew=60",
    "rag@follow_up_probability=1": "follow_up_probability=1",
    "agent@steps_mean=1e300": "steps_mean=1e+300",
    "mixed@turns_mean=1e300": "turns_mean=1e+300",
    "chat@system_prompt_skew=400.0": "system_prompt_skew=400.0",
    "chat@conversations_per_s=1e-306": "conversations_per_s=1e-306",
    "chat@user_tokens_mean=1e308": "user_tokens_mean=1e+308",
    "chat@length_sigma=1e200": "length_sigma=1e+200",
    "chat@num_conversations=1000000000000": "num_conversations=1000000000000",
    "few-shot@template_tokens=(1, 4611686018427387904)": "template_tokens",
    "chat@system_prompt_tokens=(0, 4611686018427387904)": "system_prompt_tokens",
    "mixed@retention_s=1e300": "retention_s=1e+300",
    "rag@instruction_tokens=1180591620717411303424": "instruction_tokens=1180591620717411303424",
    "rag@document_skew=8.0": "document_skew=8.0 with docs_per_request=3",
    "chat@block_size=1099511627776": "block_size=1099511627776",
}


@pytest.mark.parametrize(("name", "quoted"), OUTSIDE.items(), ids=OUTSIDE.keys())
def test_a_value_outside_its_bound_is_a_config_error_quoting_it(name, quoted):
    """A parameter that would hang, exhaust memory or overflow is refused at construction, quoted."""
    with pytest.raises(ConfigError, match=rf"{name.split('@')[0]}.*{quoted.replace('(', '.').replace('+', '.')}"):
        shape(name)


@pytest.mark.parametrize("name", ["chat@system_prompt_skew=8.0;turns_skew=8.0", "few-shot@template_skew=8.0",
                                  "rag@document_skew=2.0", "chat@conversations_per_s=1e-06",
                                  "chat@user_tokens_mean=1048576.0;max_context_tokens=2097152"])
def test_values_at_the_bounds_generate_finite_requests(name):
    """Skews, rates and lengths at their bounds stay within floats: the first requests come, finite."""
    for request in itertools.islice(shape(name).requests(), 30):
        assert math.isfinite(request.timestamp_ms) and request.input_length >= 1
