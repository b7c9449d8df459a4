"""A character-level HF tokenizer (lower-case letters and space, ``</s>`` as EOS) built in memory,
for data-path tests that must not download one."""


def char_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(["[UNK]", "</s>", *"abcdefghijklmnopqrstuvwxyz "])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", eos_token="</s>")
