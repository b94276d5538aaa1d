"""Models and checkpoints: HF equality, SmolLM2, loading, Hugging Face ids."""
