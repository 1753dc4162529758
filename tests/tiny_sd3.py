"""A tiny StableDiffusion3Pipeline with random weights, built in code (no download), for the tests of
train_sd.py: SD3.5's parts (two CLIP text encoders and a T5 one, an AutoencoderKL, an MMDiT-X
transformer with dual attention and RMS qk-norm, FlowMatchEulerDiscreteScheduler) at a size that
trains in seconds on a CPU. Its images mean nothing: the tests check contracts, not learning
(lab/mini_sd3_pipeline.py builds and pretrains one whose images do)."""

import torch

LETTERS = "abcdefghijklmnopqrstuvwxyz"
TOKENS = 16  # CLIP and T5 tokens per prompt


def build(folder, seed=0):
    """Build the pipeline and save it with save_pretrained into folder; returns folder."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection, CLIPTokenizer, T5Config, T5EncoderModel
    from transformers import T5Tokenizer

    torch.manual_seed(seed)
    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1, **{c + e: 2 + 2 * i + j for i, c in enumerate(LETTERS)
                                                          for j, e in enumerate(("", "</w>"))}}
    clip_tok = CLIPTokenizer(vocab=vocab, merges=[], model_max_length=TOKENS)  # a word is spelled letter by letter
    t5_tok = T5Tokenizer(vocab=[("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -2.0)]
                         + [(c, -1.0) for c in LETTERS], extra_ids=0, model_max_length=TOKENS)

    def clip():
        return CLIPTextModelWithProjection(CLIPTextConfig(
            vocab_size=len(clip_tok), hidden_size=16, intermediate_size=32, projection_dim=16, num_attention_heads=2,
            num_hidden_layers=1, max_position_embeddings=TOKENS, bos_token_id=0, eos_token_id=1, pad_token_id=1))

    t5 = T5EncoderModel(T5Config(vocab_size=len(t5_tok), d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4,
                                 pad_token_id=0, eos_token_id=1, decoder_start_token_id=0))
    vae = AutoencoderKL(in_channels=3, out_channels=3, block_out_channels=(8, 8), latent_channels=4, layers_per_block=1,
                        norm_num_groups=8, sample_size=16, mid_block_add_attention=False,
                        down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
                        use_quant_conv=False, use_post_quant_conv=False)
    transformer = SD3Transformer2DModel(sample_size=8, patch_size=2, in_channels=4, out_channels=4, num_layers=1,
                                        attention_head_dim=8, num_attention_heads=2, joint_attention_dim=32,
                                        caption_projection_dim=16, pooled_projection_dim=32, pos_embed_max_size=8,
                                        dual_attention_layers=(0,), qk_norm="rms_norm")
    pipe = StableDiffusion3Pipeline(transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
                                    vae=vae, text_encoder=clip(), tokenizer=clip_tok, text_encoder_2=clip(),
                                    tokenizer_2=clip_tok, text_encoder_3=t5, tokenizer_3=t5_tok)
    pipe.save_pretrained(str(folder))
    return str(folder)
