"""What the runtime needs to tokenise without a template engine, read from the checkpoint's tokenizer."""

from .errors import CheckpointError

MAX_SEQUENCE_LENGTH = 512  # Flux2KleinPipeline.tokenizer_max_length
_SENTINEL = "\ue000klein-prompt\ue000"


def tokenizer_facts(tokenizer) -> dict:
    """Render the chat template around a sentinel and split it into prefix and suffix.

    Rendered exactly as `Flux2KleinPipeline._get_qwen3_prompt_embeds` does: one user message,
    `add_generation_prompt=True, enable_thinking=False`, no system prompt.
    """

    def render(content):
        return tokenizer.apply_chat_template(
            [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True, enable_thinking=False
        )

    prefix, suffix = split_template(render)
    if tokenizer.pad_token_id is None:
        raise CheckpointError("the tokenizer has no pad token")
    return {
        "file": "tokenizer.json",
        "prompt_prefix": prefix,
        "prompt_suffix": suffix,
        "pad_token": tokenizer.pad_token,
        "pad_token_id": int(tokenizer.pad_token_id),
        "padding_side": tokenizer.padding_side,
        "max_sequence_length": MAX_SEQUENCE_LENGTH,
        "add_special_tokens": False,
    }


def split_template(render) -> tuple:
    """`render(content)`'s text for one user message, as the prefix and suffix around the prompt;
    CheckpointError unless the template is such a plain wrapper."""
    try:
        text = render(_SENTINEL)
    except ValueError as e:  # no template, or one that cannot render
        raise CheckpointError(f"the tokenizer's chat template cannot be used: {e}") from None
    if text.count(_SENTINEL) != 1:
        raise CheckpointError("the chat template does not contain the prompt exactly once")
    prefix, suffix = text.split(_SENTINEL)
    # The template must be a plain wrapper: another prompt renders with the same prefix and suffix.
    if render("other prompt") != prefix + "other prompt" + suffix:
        raise CheckpointError("the chat template is not a fixed prefix + prompt + suffix; klein cannot reproduce it")
    return prefix, suffix
