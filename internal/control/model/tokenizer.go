package model

import (
	"fmt"
	"strconv"
)

// Special token ids of the byte-level tokenizer. Every byte b of a text is
// the token ByteOffset+b; the ids below ByteOffset are markers that only the
// server itself inserts (prompt structure and tool-call boundaries).
const (
	TokenPad         int64 = 0 // never emitted; reserved
	TokenBOS         int64 = 1 // start of a prompt
	TokenEOS         int64 = 2 // reserved for end of sequence
	TokenIMStart     int64 = 3 // start of one message in a prompt
	TokenIMEnd       int64 = 4 // end of one message in a prompt
	TokenToolCall    int64 = 5 // start of one tool call
	TokenToolCallEnd int64 = 6 // end of one tool call

	// ByteOffset is the id of byte 0x00; byte b is ByteOffset+b.
	ByteOffset int64 = 16
	// VocabSize is the number of ids: the specials, padding up to
	// ByteOffset, and the 256 bytes.
	VocabSize int64 = ByteOffset + 256
)

var specialText = map[int64]string{
	TokenPad:         "<|pad|>",
	TokenBOS:         "<|bos|>",
	TokenEOS:         "<|eos|>",
	TokenIMStart:     "<|im_start|>",
	TokenIMEnd:       "<|im_end|>",
	TokenToolCall:    "<tool_call>",
	TokenToolCallEnd: "</tool_call>",
}

// Tokenize returns the token ids of s: one id per byte, ByteOffset+b. It
// never produces special ids, so Detokenize(Tokenize(s)) == s for every s.
func Tokenize(s string) []int64 {
	ids := make([]int64, len(s))
	for i := 0; i < len(s); i++ {
		ids[i] = ByteOffset + int64(s[i])
	}
	return ids
}

// Detokenize returns the text of ids: bytes for byte ids and the marker
// text (such as "<|im_start|>" or "<tool_call>") for special ids. An id
// outside the vocabulary is an error.
func Detokenize(ids []int64) (string, error) {
	b := make([]byte, 0, len(ids))
	for i, id := range ids {
		t, err := tokenBytes(id)
		if err != nil {
			return "", fmt.Errorf("token %d of %d: %w", i, len(ids), err)
		}
		b = append(b, t...)
	}
	return string(b), nil
}

// tokenBytes is the text of one id.
func tokenBytes(id int64) ([]byte, error) {
	switch {
	case id >= ByteOffset && id < VocabSize:
		return []byte{byte(id - ByteOffset)}, nil
	case id >= 0 && id < ByteOffset:
		if s, ok := specialText[id]; ok {
			return []byte(s), nil
		}
	}
	return nil, fmt.Errorf("id %d is not in the vocabulary (0..%d; %d..%d are bytes)", id, VocabSize-1, ByteOffset, VocabSize-1)
}

// tokenString is the "token" field of a logprob entry, as vLLM writes it: the
// text of the token, or "bytes:\xNN" for a byte that is not valid UTF-8 on
// its own.
func tokenString(id int64) string {
	if s, ok := specialText[id]; ok {
		return s
	}
	b := byte(id - ByteOffset)
	if b < 0x80 {
		return string([]byte{b})
	}
	return "bytes:\\x" + strconv.FormatUint(uint64(b)|0x100, 16)[1:]
}
