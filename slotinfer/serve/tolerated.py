"""Fields of the specs and of other servers' APIs that a body may carry here (docs/serve.md lists them).

Clients written for OpenAI, Anthropic, llama.cpp, vLLM or mlx-lm send fields of their own.  Each one
is, here:

- **ignored**: it changes nothing a client gets back (bookkeeping, hints, speed-only options,
  windows of a penalty slotinfer applies to every token);
- **neutral only**: accepted at the value that changes nothing, and a 400 naming it at any other
  (slotinfer cannot honour it, and running without it would silently give another answer);
- **mapped**: the same meaning as a parameter here (``n_predict`` is ``max_tokens``; the parsers
  map them).

A field in no one's schema is still a 400 with the close match (``check_fields``).
"""

from __future__ import annotations

from ..request import short
from .errors import bad_param

IGNORED = (
    # OpenAI (chat, completions, responses)
    "user", "service_tier", "store", "metadata", "prompt_cache_key", "prompt_cache_retention", "safety_identifier",
    "prediction", "verbosity",
    # llama.cpp server
    "cache_prompt", "id_slot", "slot_id", "n_keep", "n_indent", "t_max_predict_ms", "timings_per_token",
    "return_progress", "samplers", "repeat_last_n", "penalize_nl", "mirostat_tau", "mirostat_eta",
    "dynatemp_exponent", "dry_base", "dry_allowed_length", "dry_penalty_last_n", "dry_sequence_breakers",
    "xtc_threshold", "reasoning_format", "thinking_forced_open", "parse_tool_calls", "response_fields",
    # vLLM
    "priority", "request_id", "kv_transfer_params", "vllm_xargs", "mm_processor_kwargs",
    # mlx-lm server
    "repetition_context_size", "draft_model", "num_draft_tokens",
)

# field -> the value (or values) that change nothing
NEUTRAL = {
    "modalities": (["text"],), "audio": (None,), "web_search_options": (None,),
    "typical_p": (1, 1.0), "tfs_z": (1, 1.0), "mirostat": (0,), "dynatemp_range": (0, 0.0), "dry_multiplier": (0, 0.0),
    "xtc_probability": (0, 0.0), "n_probs": (0,), "post_sampling_probs": (False,), "lora": ([], None),
    "grammar": (None, ""), "return_tokens": (False,),
    "use_beam_search": (False,), "length_penalty": (1, 1.0), "min_tokens": (0,), "include_stop_str_in_output": (False,),
    "spaces_between_special_tokens": (True,), "add_generation_prompt": (True,), "continue_final_message": (False,),
    "prompt_logprobs": (None,), "allowed_token_ids": (None, []), "bad_words": (None, []),
    "truncate_prompt_tokens": (None,), "return_tokens_as_token_ids": (False,), "return_token_ids": (False, None),
    "documents": (None,), "chat_template": (None,), "logits_processors": (None, []),
    "adapters": (None,), "role_mapping": (None,),
}

_WHY = {"grammar": "llama.cpp's GBNF grammars are not read here: send a Lark grammar as structured_outputs.grammar",
        "chat_template": "this server renders with the model's own chat template",
        "lora": "this server runs the base model only", "adapters": "this server runs the base model only"}

MAPPED = ("n_predict", "repeat_penalty", "json_schema", "chat_template_kwargs", "enable_thinking", "reasoning_effort")
EXTRA = (*IGNORED, *NEUTRAL, *MAPPED)  # what every generation endpoint takes beside its own fields


def check_neutral(body: dict):
    """400 naming the first field of ``body`` set to what slotinfer cannot honour."""
    for name, values in NEUTRAL.items():
        if name in body and not any(body[name] == v and type(body[name]) is type(v) or body[name] is v
                                    for v in values):
            why = _WHY.get(name, "slotinfer does not implement it")
            raise bad_param(name, f"'{name}' {short(body[name])} is not supported here ({why}); leave it out, or send "
                                  f"{short(values[0])}")
