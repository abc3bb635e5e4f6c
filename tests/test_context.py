"""One rule for a KV cache's size (config.check_context): the CLI's --context, serve's --max-tokens and the API's
new_cache all refuse more tokens than the model's context, with the same one-line error."""

import pytest

import diffgemma
from diffgemma import cli, options
from diffgemma.config import check_context
from diffgemma.errors import InputError


@pytest.fixture(scope="module")
def model():
    return diffgemma.load()


def test_the_rule(model):
    assert model.config.max_positions == 4096
    assert check_context(model.config, 4096) == 4096 and check_context(model.config, 1, "--context") == 1
    for bad, needle in ((4097, "max_tokens 4097: over this model's context of 4096 tokens"),
                        (0, "max_tokens 0: expected a positive number of tokens"),
                        (True, "max_tokens True: expected a positive number"),
                        (512.0, "max_tokens 512.0: expected a positive number")):
        with pytest.raises(InputError, match=needle):
            check_context(model.config, bad)
    assert options.context_tokens(model) == 4096  # the default, clipped to the model's context
    with pytest.raises(InputError, match="^--context 100000: over this model's context of 4096 tokens"):
        options.context_tokens(model, 100000, "--context")


def test_the_cli_and_the_server_refuse_what_the_rule_refuses(capsys):
    for argv, flag in ((["ask", "hi", "--context", "100000"], "--context"),
                       (["serve", "--max-tokens", "100000"], "--max-tokens")):
        assert cli.main(argv) == 2
        err = capsys.readouterr().err
        assert err == f"diffgemma: error: {flag} 100000: over this model's context of 4096 tokens " \
                      f"(text_config.max_position_embeddings); use at most 4096\n"


def test_new_cache_follows_the_rule(model):
    with pytest.raises(InputError, match="max_tokens 100000: over this model's context of 4096 tokens"):
        model.new_cache(max_tokens=100000)
