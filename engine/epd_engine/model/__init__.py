"""LLaVA-1.5 in PyTorch, split by stage.

- ``model_config``: parse a Hugging Face ``config.json`` (``LlavaModelConfig``).
- ``llava``: ``LlavaVision`` (E stage) and ``LlavaLanguage`` (P/D stages).
- ``attention`` / ``attention_torch``: the backend seam and its plain-torch implementation.
- ``loader``: ``load_vision`` / ``load_language`` read only their part of the safetensors.
- ``make_model`` / ``presets`` / ``make_tokenizer``: random-weight checkpoints in hub layout.
- ``generate``: a one-sequence greedy reference loop.

Submodules are imported explicitly (this package stays import-light).
"""
