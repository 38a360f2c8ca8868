package ledger

import "encoding/json"

// Tokens are the token ids and logprobs of one call, when the model server
// gave them.
type Tokens struct {
	PromptIDs     []int64   `json:"prompt_token_ids,omitempty"`
	CompletionIDs []int64   `json:"completion_token_ids,omitempty"`
	Logprobs      []float64 `json:"logprobs,omitempty"` // one per completion token
}

// ExtractTokens reads the token extensions of vLLM and SGLang from a chat
// completion: the top-level "prompt_token_ids" (or choices[0].prompt_token_ids),
// choices[0].token_ids, and choices[0].logprobs.content[].logprob. Absent,
// null or mistyped fields are skipped; it returns nil when there are none.
func ExtractTokens(response json.RawMessage) *Tokens {
	_, t := extract(response)
	return t
}

// extract reads, in one pass over the response, its usage and its tokens
// (nil when it has none).
func extract(response json.RawMessage) (usage json.RawMessage, tokens *Tokens) {
	if json.Valid(response) {
		if s := scanTokens(response); s.tokensOK {
			return s.usage, s.tokens
		}
	}
	return extractJSON(response)
}

// extractJSON is extract by encoding/json: what scanResponse must agree
// with, and what it falls back to.
func extractJSON(response json.RawMessage) (usage json.RawMessage, tokens *Tokens) {
	var r struct {
		Usage     json.RawMessage   `json:"usage"`
		PromptIDs json.RawMessage   `json:"prompt_token_ids"`
		Choices   []json.RawMessage `json:"choices"`
	}
	if json.Unmarshal(response, &r) != nil {
		return nil, nil
	}
	if string(r.Usage) != "null" {
		usage = r.Usage
	}
	return usage, tokensOf(r.PromptIDs, r.Choices)
}

func tokensOf(promptIDs json.RawMessage, choices []json.RawMessage) *Tokens {
	var t Tokens
	t.PromptIDs = ids(promptIDs)
	if len(choices) > 0 {
		var c struct {
			PromptIDs json.RawMessage `json:"prompt_token_ids"`
			TokenIDs  json.RawMessage `json:"token_ids"`
			Logprobs  json.RawMessage `json:"logprobs"`
		}
		if json.Unmarshal(choices[0], &c) == nil {
			if len(t.PromptIDs) == 0 {
				t.PromptIDs = ids(c.PromptIDs)
			}
			t.CompletionIDs = ids(c.TokenIDs)
			var lp struct {
				Content []struct {
					Logprob *float64 `json:"logprob"`
				} `json:"content"`
			}
			if json.Unmarshal(c.Logprobs, &lp) == nil {
				for _, x := range lp.Content {
					if x.Logprob == nil {
						t.Logprobs = nil // a gap: the list would not line up with the tokens
						break
					}
					t.Logprobs = append(t.Logprobs, *x.Logprob)
				}
			}
		}
	}
	if len(t.PromptIDs) == 0 && len(t.CompletionIDs) == 0 && len(t.Logprobs) == 0 {
		return nil
	}
	return &t
}

// ids decodes a list of token ids, or returns nil when raw is anything else
// (a partly decoded list would be wrong ids).
func ids(raw json.RawMessage) []int64 {
	var v []int64
	if json.Unmarshal(raw, &v) != nil {
		return nil
	}
	return v
}
