"""Model implementations, chosen by the `architectures` entry of config.json."""

from __future__ import annotations

from typing import Callable, Type

from torch import nn

from minisgl.models.config import BARE_DECODERS, ModelConfig
from minisgl.utils.registry import Registry

MODELS: Registry[Callable[[], Type[nn.Module]]] = Registry("model architecture")


@MODELS.register("LlamaForCausalLM")
def _llama() -> Type[nn.Module]:
    from minisgl.models.llama import LlamaForCausalLM

    return LlamaForCausalLM


@MODELS.register("MistralForCausalLM")
def _mistral() -> Type[nn.Module]:
    from minisgl.models.llama import MistralForCausalLM

    return MistralForCausalLM


@MODELS.register("Qwen2ForCausalLM")
def _qwen2() -> Type[nn.Module]:
    from minisgl.models.qwen2 import Qwen2ForCausalLM

    return Qwen2ForCausalLM


@MODELS.register("Qwen3ForCausalLM")
def _qwen3() -> Type[nn.Module]:
    from minisgl.models.qwen3 import Qwen3ForCausalLM

    return Qwen3ForCausalLM


@MODELS.register("Qwen3MoeForCausalLM")
def _qwen3_moe() -> Type[nn.Module]:
    from minisgl.models.qwen3_moe import Qwen3MoeForCausalLM

    return Qwen3MoeForCausalLM


@MODELS.register("Phi3ForCausalLM")
def _phi3() -> Type[nn.Module]:
    from minisgl.models.phi3 import Phi3ForCausalLM

    return Phi3ForCausalLM


@MODELS.register("DeepseekV2ForCausalLM")
def _deepseek_v2() -> Type[nn.Module]:
    from minisgl.models.deepseek import DeepseekV2ForCausalLM

    return DeepseekV2ForCausalLM


@MODELS.register("DeepseekV3ForCausalLM")
def _deepseek_v3() -> Type[nn.Module]:
    from minisgl.models.deepseek import DeepseekV3ForCausalLM

    return DeepseekV3ForCausalLM


@MODELS.register("MixtralForCausalLM")
def _mixtral() -> Type[nn.Module]:
    from minisgl.models.mixtral import MixtralForCausalLM

    return MixtralForCausalLM


@MODELS.register("Qwen2MoeForCausalLM")
def _qwen2_moe() -> Type[nn.Module]:
    from minisgl.models.qwen2_moe import Qwen2MoeForCausalLM

    return Qwen2MoeForCausalLM


@MODELS.register("Olmo2ForCausalLM")
def _olmo2() -> Type[nn.Module]:
    from minisgl.models.olmo2 import Olmo2ForCausalLM

    return Olmo2ForCausalLM


@MODELS.register("GraniteForCausalLM")
def _granite() -> Type[nn.Module]:
    from minisgl.models.granite import GraniteForCausalLM

    return GraniteForCausalLM


@MODELS.register("SmolLM3ForCausalLM")
def _smollm3() -> Type[nn.Module]:
    from minisgl.models.smollm3 import SmolLM3ForCausalLM

    return SmolLM3ForCausalLM


@MODELS.register("Glm4ForCausalLM")
def _glm4() -> Type[nn.Module]:
    from minisgl.models.glm4 import Glm4ForCausalLM

    return Glm4ForCausalLM


@MODELS.register("Gemma2ForCausalLM")
def _gemma2() -> Type[nn.Module]:
    from minisgl.models.gemma import Gemma2ForCausalLM

    return Gemma2ForCausalLM


@MODELS.register("Gemma3ForCausalLM")
def _gemma3() -> Type[nn.Module]:
    from minisgl.models.gemma import Gemma3ForCausalLM

    return Gemma3ForCausalLM


@MODELS.register("GptOssForCausalLM")
def _gpt_oss() -> Type[nn.Module]:
    from minisgl.models.gpt_oss import GptOssForCausalLM

    return GptOssForCausalLM


def create_model(config: ModelConfig) -> nn.Module:
    # a bare decoder (an embedding model) is built as its causal LM, the LM head tied to the embedding
    arch = BARE_DECODERS.get(config.architecture, config.architecture)
    return MODELS.get(arch)()(config)


__all__ = ["ModelConfig", "MODELS", "create_model"]
