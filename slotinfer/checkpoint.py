"""``Checkpoint``: a loaded decoder with its tokenizer, below everything that runs it."""

from __future__ import annotations

from pathlib import Path

from .errors import InvalidRequestError, PromptTooLongError
from .models import ModelConfig, Transformer


class Checkpoint:
    """A loaded decoder: the network, its config, its tokenizer and end-of-sequence ids, with
    prompt encoding and chat rendering.  The engine runs one of these; it knows nothing of who
    drives it (:class:`~slotinfer.model.Model` adds the structured-output compiler and the library's
    functions as methods)."""

    def __init__(self, net: Transformer | None, config: ModelConfig, tokenizer, *, eos_ids, dtype, path: Path):
        self._net = net
        self.config = config
        self.tokenizer = tokenizer
        self.eos_ids = frozenset(eos_ids)
        self.dtype = dtype
        self.path = path

    def __repr__(self):
        c = self.config
        return (f"{type(self).__name__}({self.path.name!r}, {c.model_type}, layers={c.num_layers}, "
                f"hidden={c.hidden_size}, vocab={c.vocab_size}, dtype={self.dtype})")

    @property
    def net(self) -> Transformer:
        """The network; a checkpoint loaded with ``weights=False`` has none and says so."""
        if self._net is None:
            raise InvalidRequestError(
                f"{self.path.name} was loaded with weights=False (config, tokenizer and template only): it can "
                "render and encode prompts but not run them; load it again with slotinfer.load(path)")
        return self._net

    @property
    def has_weights(self) -> bool:
        return self._net is not None

    @property
    def context_length(self) -> int:
        return self.config.max_position_embeddings

    # -- prompts ---------------------------------------------------------------

    def encode_prompt(self, prompt, *, add_special_tokens: bool = True, what: str = "prompt") -> list[int]:
        """A string is tokenized by the model's own rules; a list of ids is used exactly as given.

        ``add_special_tokens=False`` leaves out BOS (for text that follows a prefix);
        ``what`` names the input in error messages.
        """
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError(f"the {what} is empty; give at least one character or token id")
            ids = self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
        elif isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            ids = list(prompt)
            bad = [t for t in ids if not 0 <= t < self.config.vocab_size]
            if bad:
                raise InvalidRequestError(
                    f"{what} token ids {bad[:5]} are outside the vocabulary [0, {self.config.vocab_size})")
        else:
            raise InvalidRequestError(f"a {what} must be a str or a list of int token ids, got {type(prompt).__name__}")
        if not ids:
            raise InvalidRequestError(f"the {what} is empty (it tokenizes to no tokens)")
        if len(ids) >= self.context_length:
            raise PromptTooLongError(
                f"the {what} has {len(ids)} tokens; the model's context is {self.context_length}: shorten the {what}"
            )
        return ids

    def apply_chat_template(self, messages, *, add_generation_prompt: bool = True, tokenize: bool = False, **extra):
        """Render ``messages`` ([{"role": ..., "content": ...}]) with the checkpoint's own chat template."""
        return self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tokenize=tokenize, **extra
        )

    def chat_prompt(self, prompt=None, messages=None):
        """The prompt of a request given as ``prompt`` or as chat ``messages`` (exactly one of them):
        messages are rendered with the model's chat template, with the generation prompt."""
        if messages is None:
            if prompt is None:
                raise InvalidRequestError("give a prompt, or messages=[{'role': 'user', 'content': ...}]")
            return prompt
        if prompt is not None:
            raise InvalidRequestError("give a prompt or messages, not both")
        return self.apply_chat_template(messages, add_generation_prompt=True)
