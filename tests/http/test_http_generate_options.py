"""The OpenAI options of the completions endpoints (`generate_options`), without a socket: what
maps to a generate option, what is accepted only as its default, and errors named by the key
the client sent (not the daemon's generate key)."""

from __future__ import annotations

import pytest

from dynbatchd_plugins.httpgenerate import generate_options
from dynbatchd_plugins.httpwire import HttpError


def test_openai_names_map_to_generate_options():
    body = {"max_tokens": 5, "temperature": 0.5, "top_k": 4, "seed": 7, "stop": "\n"}
    assert generate_options(body) == {"max_new_tokens": 5, "temperature": 0.5, "top_k": 4, "seed": 7,
                                      "stop": ["\n"]}
    assert generate_options({"max_completion_tokens": 3}) == {"max_new_tokens": 3}


@pytest.mark.parametrize("explicit", [{"n": 1}, {"top_p": 1.0}, {"best_of": 1}, {"echo": False},
                                      {"logprobs": False}, {"logprobs": None}, {"suffix": ""}, {"suffix": None}])
def test_an_unsupported_option_sent_as_its_default_is_accepted(explicit):
    # e.g. chat clients that send "logprobs": false, the chat API's own default
    assert generate_options({"max_tokens": 2, **explicit}) == {"max_new_tokens": 2}


@pytest.mark.parametrize("body, named", [({"n": 2}, '"n"'), ({"top_p": 0.9}, '"top_p"'),
                                         ({"logprobs": True}, '"logprobs"'), ({"logprobs": 0}, '"logprobs"'),
                                         ({"logprobs": 3}, '"logprobs"'), ({"echo": True}, '"echo"'),
                                         ({"suffix": "end"}, '"suffix"'), ({"n": True}, '"n"')])
def test_an_unsupported_option_asking_for_more_is_400_naming_it(body, named):
    with pytest.raises(HttpError) as refused:
        generate_options(body)
    assert refused.value.status == 400 and refused.value.message.startswith(named)


@pytest.mark.parametrize("body, named", [({"max_tokens": 0}, '"max_tokens" must be'),
                                         ({"max_completion_tokens": -1}, '"max_completion_tokens" must be'),
                                         ({"temperature": "hot"}, '"temperature" must be'),
                                         ({"seed": -1}, '"seed" must be'),
                                         ({"stop": ["a", ""]}, '"stop" must be')])
def test_a_bad_value_is_400_named_as_the_client_named_it(body, named):
    with pytest.raises(HttpError) as refused:
        generate_options(body)
    assert refused.value.status == 400 and refused.value.message.startswith(named)
    assert "generate." not in refused.value.message
