"""ChatTemplate renders exactly what Hugging Face's apply_chat_template renders."""
import pytest
from transformers import PreTrainedTokenizerFast

from components.model.chat import ChatTemplate
from components.model.fetch import default_model_path
from components.model.vocab import load_tokenizer

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
    return PreTrainedTokenizerFast(tokenizer_object=bundle.tokenizer,
                                   chat_template=bundle.chat_template,
                                   bos_token=bundle.bos_token, eos_token=bundle.eos_token)


@pytest.fixture(scope="module")
def template(bundle):
    return ChatTemplate(bundle.chat_template, bundle.bos_token, bundle.eos_token)


@pytest.mark.parametrize("name", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_model_template_matches_hf(template, hf, name, add_generation_prompt):
    messages = CONVERSATIONS[name]
    expected = hf.apply_chat_template(messages, tokenize=False,
                                      add_generation_prompt=add_generation_prompt)
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
    rendered = ChatTemplate("{{ messages[0].content | tojson }}").render(
        [{"role": "user", "content": "é😀\"x"}])
    assert rendered == '"é😀\\"x"'


def test_broken_template_is_value_error():
    with pytest.raises(ValueError, match="invalid chat template"):
        ChatTemplate("{% for m in messages %}{{ m.content }", None, None)


def test_raise_exception_is_value_error():
    template = ChatTemplate("{% if messages[0].role != 'user' %}"
                            "{{ raise_exception('first must be user') }}{% endif %}ok")
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
    from components.model.prompt import PromptHasher
    from schemas.config import EngineConfig, Topology, WeirConfig

    p = PromptHasher(WeirConfig(Topology(run_dir="/nonexistent"),
                                engine=EngineConfig(model=str(default_model_path()))))
    vocab = p.bundle.vocab_size
    assert p.tokenize(None, None, [1, vocab - 1]) == [1, vocab - 1]
    assert p.tokenize(None, None, [vocab]) == f"prompt_token_ids must be in [0, {vocab})"
    assert p.tokenize("hi", None, None, {vocab - 1: 5.0}) == p.tokenize("hi", None, None)
    assert p.tokenize("hi", None, None, {vocab: 5.0}) == \
        f"logit_bias keys must be token ids in [0, {vocab})"


TOOL_TEMPLATE = """{% if tools %}[TOOLS]{{ tools | tojson }}
{% endif %}{% for m in messages %}[{{ m.role }}]{% if m.tool_calls %}{% for c in m.tool_calls %}<call {{ c.id }}>{{ c.function.name }}{{ c.function.arguments | tojson }}</call>{% endfor %}{% else %}{{ m.content }}{% endif %}{% if m.tool_call_id %} (for {{ m.tool_call_id }}){% endif %}
{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}"""  # noqa: E501 - its newlines are output

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}


def _agent_turn():
    from schemas.client import ChatMessage, Tool, ToolCall

    messages = (ChatMessage("user", "Weather in Paris?"),
                ChatMessage("assistant", "", (ToolCall("call_1", "get_weather",
                                                       '{"city": "Paris"}'),)),
                ChatMessage("tool", "18 C, sunny", tool_call_id="call_1"))
    tool = Tool("get_weather", "The weather in a city",
                '{"type": "object", "properties": {"city": {"type": "string"}}}')
    return messages, tool


def _hasher(template: str | None = None):
    from components.model.prompt import PromptHasher
    from schemas.config import EngineConfig, Topology, WeirConfig

    p = PromptHasher(WeirConfig(Topology(run_dir="/nonexistent"),
                                engine=EngineConfig(model=str(default_model_path()))))
    if template is not None:
        p.chat = ChatTemplate(template, p.bundle.bos_token, p.bundle.eos_token)
    return p


def test_tools_and_calls_render_as_hugging_face_renders_them(hf):
    """A template that reads ``tools`` and ``tool_calls`` gets OpenAI's shapes, the calls'
    arguments parsed, exactly as transformers' apply_chat_template is given them."""
    messages, tool = _agent_turn()
    p = _hasher(TOOL_TEMPLATE)
    ids = p.tokenize(None, messages, None, tools=(tool,))
    want = hf.apply_chat_template(
        [{"role": "user", "content": "Weather in Paris?"},
         {"role": "assistant", "content": "", "tool_calls": [
             {"id": "call_1", "type": "function",
              "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
         {"role": "tool", "content": "18 C, sunny", "tool_call_id": "call_1"}],
        tools=[WEATHER], chat_template=TOOL_TEMPLATE, tokenize=False,
        add_generation_prompt=True)
    assert '[TOOLS][{"type": "function"' in want and '<call call_1>get_weather{"city"' in want
    assert p.bundle.decode(ids, skip_special_tokens=False) == want


def test_calls_reach_a_template_that_does_not_read_them_as_text():
    """SmolLM2's template reads neither ``tools`` nor ``tool_calls``: the assistant's calls
    become its text (the model still sees what it called), the tool's answer a turn."""
    messages, tool = _agent_turn()
    p = _hasher()
    text = p.bundle.decode(p.tokenize(None, messages, None, tools=(tool,)),
                           skip_special_tokens=False)
    assert ('<|im_start|>assistant\n[{"name": "get_weather", "arguments": {"city": "Paris"}}]'
            '<|im_end|>\n<|im_start|>tool\n18 C, sunny<|im_end|>') in text
    assert "The weather in a city" not in text          # tools are the template's to show


@pytest.mark.parametrize("template", [None, TOOL_TEMPLATE], ids=["smollm2", "reads_tools"])
def test_json_nested_past_the_recursion_limit_is_text_not_a_crash(template):
    """A tool's parameters and a call's arguments are parsed for the template; 100,000
    ``[`` (legal: 100,000 characters, within the prompt's budget) raised RecursionError
    out of the tokenizer process and the router. Now they are text, as other non-JSON."""
    from schemas.client import ChatMessage, Tool, ToolCall

    p = _hasher(template)
    deep = "[" * 100_000
    for messages, tools in (((ChatMessage("user", "hi"),), (Tool("f", parameters=deep),)),
                            ((ChatMessage("assistant", "", (ToolCall("c1", "f", deep),)),), ())):
        ids = p.tokenize(None, messages, None, tools=tools)
        assert isinstance(ids, list), ids           # rendered (the text, where shown)
