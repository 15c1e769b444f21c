"""Text: the model's tokenizer and streaming detokenization, chat templates, stop strings, tool
calls and reasoning split out of replies."""
