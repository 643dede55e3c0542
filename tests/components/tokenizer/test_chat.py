"""ChatTemplate renders exactly what Hugging Face's apply_chat_template renders."""
import pytest
from transformers import PreTrainedTokenizerFast

from components.tokenizer.chat import ChatTemplate
from components.tokenizer.vocab import load_tokenizer
from weir.model_fetch import default_model_path

CONVERSATIONS = {
    "user": [{"role": "user", "content": "What is 2+2?"}],
    "system_user": [
        {"role": "system", "content": "You are a pirate."},
        {"role": "user", "content": "Héllo 😀, say hi"},
    ],
    "multi_turn": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Tell me a joke\nin two lines."},
    ],
    "no_system_multi_turn": [
        {"role": "user", "content": "one"},
        {"role": "assistant", "content": "two"},
        {"role": "user", "content": "three"},
    ],
}

CUSTOM_TEMPLATE = """{{ bos_token }}
{% for m in messages %}
    {% if m.role == 'system' %}
[SYS]{{ m.content | tojson }}
    {% else %}
[{{ m.role | upper }}] {{ m.content }}{{ eos_token }}
    {% endif %}
{% endfor %}
{% if add_generation_prompt %}
[ASSISTANT]
{% endif %}"""


@pytest.fixture(scope="module")
def bundle():
    return load_tokenizer(default_model_path())


@pytest.fixture(scope="module")
def hf(bundle):
    return PreTrainedTokenizerFast(tokenizer_object=bundle.tokenizer, chat_template=bundle.chat_template,
                                   bos_token=bundle.bos_token, eos_token=bundle.eos_token)


@pytest.fixture(scope="module")
def template(bundle):
    return ChatTemplate(bundle.chat_template, bundle.bos_token, bundle.eos_token)


@pytest.mark.parametrize("name", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_model_template_matches_hf(template, hf, name, add_generation_prompt):
    messages = CONVERSATIONS[name]
    expected = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert template.render(messages, add_generation_prompt=add_generation_prompt) == expected


def test_model_template_default_system_prompt(template):
    text = template.render(CONVERSATIONS["user"])
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert text.endswith("<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.parametrize("name", CONVERSATIONS)
def test_custom_template_matches_hf(hf, name):
    messages = CONVERSATIONS[name]
    expected = hf.apply_chat_template(messages, chat_template=CUSTOM_TEMPLATE, tokenize=False,
                                      add_generation_prompt=True)
    rendered = ChatTemplate(CUSTOM_TEMPLATE, "<|im_start|>", "<|im_end|>").render(messages)
    assert rendered == expected
    assert "[ASSISTANT]" in rendered and "<|im_start|>system" not in rendered


def test_tojson_keeps_unicode():
    rendered = ChatTemplate("{{ messages[0].content | tojson }}").render([{"role": "user", "content": "é😀\"x"}])
    assert rendered == '"é😀\\"x"'


def test_broken_template_is_value_error():
    with pytest.raises(ValueError, match="invalid chat template"):
        ChatTemplate("{% for m in messages %}{{ m.content }", None, None)


def test_raise_exception_is_value_error():
    template = ChatTemplate("{% if messages[0].role != 'user' %}{{ raise_exception('first must be user') }}"
                            "{% endif %}ok")
    assert template.render([{"role": "user", "content": "x"}]) == "ok"
    with pytest.raises(ValueError, match="first must be user"):
        template.render([{"role": "assistant", "content": "x"}])


def test_template_runtime_error_is_value_error(template):
    with pytest.raises(ValueError):
        template.render([{"role": "user", "content": None}])


@pytest.mark.parametrize("source", [
    "{{ messages.__class__.__mro__ }}",
    "{% set _ = messages.append({'role': 'x'}) %}",
])
def test_sandbox_blocks_unsafe_templates(source):
    with pytest.raises(ValueError):
        ChatTemplate(source).render([{"role": "user", "content": "x"}])


def test_ids_a_request_names_are_checked_against_the_vocabulary():
    """Prompt ids and logit_bias keys past the vocabulary are refused with the real bound
    (the edge validator only bounds them at 2^31 - 1)."""
    from components.tokenizer.prompt import PromptHasher
    from schemas.config import EngineConfig, Topology, WeirConfig

    p = PromptHasher(WeirConfig(Topology(run_dir="/nonexistent"),
                                engine=EngineConfig(model=str(default_model_path()))))
    vocab = p.bundle.vocab_size
    assert p.tokenize(None, None, [1, vocab - 1]) == [1, vocab - 1]
    assert p.tokenize(None, None, [vocab]) == f"prompt_token_ids must be in [0, {vocab})"
    assert p.tokenize("hi", None, None, {vocab - 1: 5.0}) == p.tokenize("hi", None, None)
    assert p.tokenize("hi", None, None, {vocab: 5.0}) == \
        f"logit_bias keys must be token ids in [0, {vocab})"
