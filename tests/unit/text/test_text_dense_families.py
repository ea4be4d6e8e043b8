"""Serving text for the dense families: a DeepSeek-R1-Distill-Qwen directory (model_type qwen2) gets the R1 chat
template (the checkpoint's own, or the built-in by its name), whose prompt opens `<think>`, and the deepseek_r1
parser splits its output; Qwen3's `<think>` output (prompt not opening it) splits under the qwen3 name, and with
thinking off the output is all content."""

from __future__ import annotations

from deepinfer_jax.text import BUILTIN_TEMPLATES, get_reasoning_parser, load_tokenizer, prompt_opens_reasoning

QWEN2 = {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "bos_token_id": 0, "eos_token_id": 1}
MESSAGES = [{"role": "user", "content": "What is 2 + 2?"}]


def test_r1_distill_qwen_template_and_reasoning(make_dir):
    for kw in ({}, {"tokenizer_config": {"chat_template": BUILTIN_TEMPLATES["deepseek_r1"]}}):
        d = make_dir("DeepSeek-R1-Distill-Qwen-7B", config=QWEN2, **kw)
        prompt = load_tokenizer(d).apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
        assert prompt.endswith("<｜Assistant｜><think>\n") and prompt_opens_reasoning(prompt)
        rp = get_reasoning_parser("deepseek_r1")(prompt_opens_reasoning(prompt))
        assert rp.extract("2 and 2 make 4.\n</think>\n\nThe answer is 4.") == ("2 and 2 make 4.\n",
                                                                           "\n\nThe answer is 4.")


def test_qwen3_reasoning():
    cls = get_reasoning_parser("qwen3")
    assert cls(False).extract("<think>\nadd them\n</think>\n\n4") == ("\nadd them\n", "\n\n4")
    # enable_thinking=False: the template closes an empty think block in the prompt; the output is content
    prompt = "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert not prompt_opens_reasoning(prompt)
    assert cls(prompt_opens_reasoning(prompt)).extract("4") == ("", "4")
