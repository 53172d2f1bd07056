"""jaxrl: pipeline RL for language models in JAX."""

import os

# transformers announces at import that PyTorch is missing ("[transformers] PyTorch was not found..."): jaxrl uses
# only its tokenizers and configs, so the line is noise on every entry point. It is the only "advisory" warning
# transformers has; this switch silences it in this process and its workers (set before transformers is imported).
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
