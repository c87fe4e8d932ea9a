"""Tiny transformers models (GPT-2 with its Conv1D layers, Llama with nn.Linear and grouped KV
heads) for the tests that put a Hugging Face model's matrices on manifolds: built from configs,
no download."""
import torch
import transformers

transformers.logging.set_verbosity_error()  # the tiny vocabulary draws a warning about GPT-2's token ids


def tiny_gpt2(seed=0):
    torch.manual_seed(seed)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32, bos_token_id=0, eos_token_id=0,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))


def tiny_llama(seed=0):
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=64, bos_token_id=0, eos_token_id=0))
