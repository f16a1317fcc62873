"""The serving engine: continuous batching over the paged KV cache with a Llama-family model."""

from scheduler.core.config import CacheConfig, EngineConfig, LoRAConfig, SchedulerConfig
from scheduler.core.lora_request import LoRARequest
from scheduler.core.outputs import CompletionOutput, EmbeddingOutput, EmbeddingRequestOutput, RequestOutput
from scheduler.core.params import SamplingParams
from scheduler.core.pooling_params import PoolerConfig, PoolingParams
from scheduler.core.speculative_config import SpeculativeConfig
from scheduler.core.structured_params import StructuredOutputsParams
from scheduler.engine.beam_search import BeamSearch, BeamSearchOutput, BeamSearchParams
from scheduler.engine.llm_engine import LLMEngine
from scheduler.entrypoints.llm import LLM
from scheduler.model.llama import LlamaModel, ModelConfig
from scheduler.model.weights import from_hf_model, from_state_dict

__all__ = [
    "BeamSearch", "BeamSearchOutput", "BeamSearchParams", "CacheConfig", "CompletionOutput", "EmbeddingOutput",
    "EmbeddingRequestOutput", "EngineConfig", "LLM", "LLMEngine", "LlamaModel", "LoRAConfig", "LoRARequest",
    "ModelConfig", "PoolerConfig", "PoolingParams", "RequestOutput", "SamplingParams", "SchedulerConfig",
    "SpeculativeConfig", "StructuredOutputsParams", "from_hf_model", "from_state_dict",
]
