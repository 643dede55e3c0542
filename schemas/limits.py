"""The limits of a client request: the one place that says how large each field of a
``Submit`` may be. ``schemas/validate.py`` checks them; ``schemas/frames.py`` sums them
into the client sockets' frame bound. Names and ids (``request_id``, a replica's name,
an ``Idempotency-Key`` or ``X-Session-Id`` header) share ``MAX_ID_CHARS``.

Every integer a client sends is bounded here, so nothing past 64 bits (or past what a
tensor index can hold) ever reaches a later component, and every size is bounded before
any work is done on it. The limits and why:

- ``top_k``: 0 (off) .. ``MAX_TOP_K`` = 2^20. Larger vocabularies than that do not exist
  (the biggest are ~256k); a ``top_k`` at or above the model's vocabulary is valid and
  means "off", as the sampler has always treated it. Anything larger is a client bug and
  is refused, instead of overflowing an int64 in the executor (which failed every request
  in that step).
- ``n``: 1 .. ``MAX_N`` (16); admission also caps it at ``scheduler.max_num_seqs``.
- ``max_tokens``: None (until the context is full) or 1 .. ``MAX_MAX_TOKENS`` (2^31 - 1);
  with the context window known, at most ``max_model_len - 1`` (a prompt is at least one
  token, so more can never fit).
- ``seed``: any 64-bit integer, signed or unsigned (-2^63 .. 2^64 - 1).
- ``temperature``: finite, 0 (greedy) .. ``MAX_TEMPERATURE`` (100; beyond it sampling is
  uniform noise). ``top_p``: (0, 1].
- ``stop``: at most ``MAX_STOP_STRINGS`` (16) non-empty strings of at most
  ``MAX_STOP_CHARS`` (256) characters each: the detokenizer rescans a window as long as
  the longest stop string on every delta.
- ``stop_token_ids``: at most ``MAX_STOP_TOKEN_IDS`` (64), each a token id
  (0 .. ``MAX_TOKEN_ID``); the tokenizer checks ids against the real vocabulary.
- ``logit_bias``: at most ``MAX_LOGIT_BIAS`` (300, OpenAI's cap) entries, keys token ids
  (0 .. ``MAX_TOKEN_ID``; over HTTP, as decimal strings; the tokenizer checks them against
  the real vocabulary), values finite in [-100, 100].
- ``presence_penalty``, ``frequency_penalty``: finite, in [-2, 2] (OpenAI's range).
  ``repetition_penalty``: finite, in (0, ``MAX_REPETITION_PENALTY`` = 100]; 1 is off.
- ``min_tokens``: 0 .. ``max_tokens`` (or ``MAX_MAX_TOKENS`` without one).
- ``logprobs``, ``prompt_logprobs``: None (off) or 0 .. ``MAX_LOGPROBS`` (20, vLLM's
  default cap) alternatives.
- ``structured``: exactly one language; its text (a schema, regex or grammar, or the
  choices together) at most ``MAX_GRAMMAR_CHARS`` (64 Ki) characters, at most
  ``MAX_CHOICES`` (256) non-empty choices; not with ``min_tokens`` (a language that is
  complete allows only EOS, which min_tokens would ban). Whether the text parses (a valid
  schema, regex, grammar) the tokenizer checks, with the model's vocabulary.
- ``tools``: at most ``MAX_TOOLS`` (128), each named by 1-64 letters, digits, ``_`` or
  ``-`` (OpenAI's rule), no two alike; their text counts toward the prompt's size.
- ``priority``, ``deadline_ms``, ``e2e_deadline_ms``: fit a signed 64-bit integer
  (``deadline_ms`` >= 0, ``e2e_deadline_ms`` >= 1).
- ``request_id``, ``idempotency_key``, ``tenant``, ``service_class``, ``session_id``: at
  most ``MAX_ID_CHARS`` (256). ``api_key``: at most ``MAX_API_KEY_CHARS`` (4096: a JWT fits;
  no configured key is longer than its holder can send).
- Prompt size, before tokenizing: ``prompt_token_ids`` at most ``max_model_len - 1`` ids;
  text (a prompt, or all messages' roles and contents together) at most
  ``CHARS_PER_TOKEN_BOUND`` (32) characters per token of the context window
  (``max_model_len * 32``; 64 Ki characters at the default 2048), or an explicit
  ``max_prompt_chars``. A BPE token averages 3-5 characters of text; 32 per token of the
  whole window leaves room for whitespace- or symbol-heavy text, and anything longer could
  not have fit the context window as tokens, so it is refused as ``prompt_too_long``
  without reaching the tokenizer. ``messages`` and their ``tool_calls`` together: at most
  ``max_model_len`` (a template renders each as at least one token), and a tool call's
  ``tool_call_id`` counts toward the characters, so an empty message is not free.
"""

MAX_N = 16
MAX_TOP_K = 2**20
MAX_MAX_TOKENS = 2**31 - 1
MAX_TEMPERATURE = 100.0
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_STOP_TOKEN_IDS = 64
MAX_TOKEN_ID = 2**31 - 1
MAX_LOGIT_BIAS = 300
MAX_PENALTY = 2.0
MAX_LOGPROBS = 20
MAX_REPETITION_PENALTY = 100.0
LOGIT_BIAS_LIMIT = 100.0
MAX_ID_CHARS = 256
MAX_API_KEY_CHARS = 4096
CHARS_PER_TOKEN_BOUND = 32
MAX_GRAMMAR_CHARS = 64 * 1024
MAX_CHOICES = 256
MAX_TOOLS = 128
INT64_MIN, INT64_MAX, UINT64_MAX = -(2**63), 2**63 - 1, 2**64 - 1
