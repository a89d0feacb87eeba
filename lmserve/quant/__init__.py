"""Weight quantization by our own calibration (AWQ int4: awq.py), its checkpoint format (AutoAWQ GEMM
tensors in an HF folder: checkpoint.py), and the evaluation that measures what quantization costs
(sliding-window perplexity and top-1 agreement with the unquantized model: perplexity.py)."""
