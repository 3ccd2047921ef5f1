"""The offline API: `LLM(model_path).generate(prompts, sampling_params)`."""

from minisgl.llm.llm import LLM, GenerationResult

__all__ = ["LLM", "GenerationResult"]
