package ledger

import (
	"bytes"
	"encoding/json"
)

// scanned is what one pass over a response (valid JSON) finds: what
// extract and responseFingerprint would return, each with a flag saying
// whether the pass could tell. It could not when the response is unusual
// for that purpose — a key escaped, repeated, non-ASCII or in other case,
// a value of an unexpected type — and the caller then asks encoding/json.
type scanned struct {
	usage    json.RawMessage
	tokens   *Tokens
	tokensOK bool // usage and tokens are extract's
	fp       string
	fpOK     bool // fp is responseFingerprint's
}

// scanResponse reads, in one pass over a response that is valid JSON, its
// usage, token ids and logprobs (as extract does) and the fingerprint of
// its assistant message (as responseFingerprint does). Values it does not
// need are skipped, not decoded.
func scanResponse(resp []byte) scanned { return scan(resp, true) }

// scanTokens is scanResponse without the fingerprint (fpOK is false): what
// an append needs.
func scanTokens(resp []byte) scanned { return scan(resp, false) }

func scan(resp []byte, wantFP bool) scanned {
	s := scanned{tokensOK: true, fpOK: wantFP}
	var (
		usageSet, promptSet, choicesSet bool
		usage                           []byte
		topPrompt                       []int64
		c                               choiceScan
		nChoices                        int
	)
	end := members(resp, 0, func(key []byte, from int) int {
		var m [4]keyMatch
		for i, name := range [4]string{"usage", "prompt_token_ids", "choices", "output"} {
			if m[i] = matchKey(key, name); m[i] == keyUnusual {
				s.tokensOK, s.fpOK = false, false
				return skipValue(resp, from)
			}
		}
		switch {
		case m[0] == keyExact:
			to := skipValue(resp, from)
			if usageSet {
				s.tokensOK = false
			}
			usageSet, usage = true, resp[from:to:to]
			return to
		case m[1] == keyExact:
			if promptSet {
				s.tokensOK = false
			}
			promptSet = true
			ids, to, ok := parseIDs(resp, from)
			if !ok {
				s.tokensOK = false
				return skipValue(resp, from)
			}
			topPrompt = ids
			return to
		case m[2] == keyExact:
			if choicesSet || resp[from] != '[' {
				s.tokensOK, s.fpOK = false, false
				return skipValue(resp, from)
			}
			choicesSet = true
			return elements(resp, from, func(from int) int {
				nChoices++
				return s.choice(resp, from, nChoices == 1, wantFP, &c)
			})
		case m[3] == keyExact:
			s.fpOK = false // a responses-API object: encoding/json reads it
		}
		return skipValue(resp, from)
	})
	if end < 0 || skipSpace(resp, end) != len(resp) {
		return scanned{}
	}
	if !choicesSet || nChoices == 0 {
		s.fpOK = false
	}
	if !s.tokensOK {
		return s
	}
	if usageSet && string(usage) != "null" {
		s.usage = usage
	}
	s.tokens = c.tokens(topPrompt, nChoices > 0)
	return s
}

// tokens are the response's tokens as tokensOf reads them: the top-level
// prompt ids, else choices[0]'s; the completion ids and logprobs of
// choices[0] (c, when there is one); nil when there are none.
func (c *choiceScan) tokens(topPrompt []int64, haveChoice bool) *Tokens {
	t := Tokens{PromptIDs: topPrompt}
	if haveChoice {
		if len(t.PromptIDs) == 0 {
			t.PromptIDs = c.prompt
		}
		t.CompletionIDs = c.completion
		if !c.gap && len(c.logprobs) > 0 {
			t.Logprobs = c.logprobs
		}
	}
	if len(t.PromptIDs) > 0 || len(t.CompletionIDs) > 0 || len(t.Logprobs) > 0 {
		return &t
	}
	return nil
}

// choiceScan is what the first choice holds for the tokens.
type choiceScan struct {
	prompt, completion []int64
	logprobs           []float64
	gap                bool // a logprob is missing: the list would not line up
}

// choice walks one element of choices (first: choices[0]) and returns where
// it ends; wantFP: fingerprint choices[0]'s message.
func (s *scanned) choice(b []byte, from int, first, wantFP bool, c *choiceScan) int {
	if b[from] != '{' {
		s.tokensOK, s.fpOK = false, false // null or not an object: encoding/json decides
		return skipValue(b, from)
	}
	var promptSet, idsSet, logprobsSet, msgSet bool
	to := members(b, from, func(key []byte, from int) int {
		var m [4]keyMatch
		for i, name := range [4]string{"message", "prompt_token_ids", "token_ids", "logprobs"} {
			if m[i] = matchKey(key, name); m[i] == keyUnusual {
				s.fpOK = false
				if first {
					s.tokensOK = false
				}
				return skipValue(b, from)
			}
		}
		switch {
		case m[0] == keyExact && !wantFP:
			msgSet = true
			return skipValue(b, from)
		case m[0] == keyExact:
			to := skipValue(b, from)
			if msgSet || b[from] != '{' {
				s.fpOK = false
				return to
			}
			msgSet = true
			var msg chatMessage
			if json.Unmarshal(b[from:to], &msg) != nil {
				s.fpOK = false // encoding/json fails on the whole response
			} else if first {
				s.fp = msg.assistant().fingerprint()
			}
			return to
		case !first:
		case m[1] == keyExact, m[2] == keyExact:
			set, dst := &promptSet, &c.prompt
			if m[2] == keyExact {
				set, dst = &idsSet, &c.completion
			}
			if *set {
				s.tokensOK = false
			}
			*set = true
			ids, to, ok := parseIDs(b, from)
			if !ok {
				s.tokensOK = false
				return skipValue(b, from)
			}
			*dst = ids
			return to
		case m[3] == keyExact:
			if logprobsSet {
				s.tokensOK = false
			}
			logprobsSet = true
			to, ok := c.logprobsAt(b, from)
			if !ok {
				s.tokensOK = false
				return skipValue(b, from)
			}
			return to
		}
		return skipValue(b, from)
	})
	if first && !msgSet {
		s.fpOK = false // no message in choices[0]: encoding/json decides
	}
	return to
}

// logprobsAt reads choices[0].logprobs, {"content":[{"logprob":X,...},...]},
// at b[i]; ok is false when it is not in that shape (or null).
func (c *choiceScan) logprobsAt(b []byte, i int) (to int, ok bool) {
	if bytes.HasPrefix(b[i:], []byte("null")) {
		return i + 4, true
	}
	if b[i] != '{' {
		return 0, false
	}
	contentSet := false
	to = members(b, i, func(key []byte, from int) int {
		switch matchKey(key, "content") {
		case keyUnusual:
			return -1
		case keyOther:
			return skipValue(b, from)
		}
		if contentSet {
			return -1
		}
		contentSet = true
		if bytes.HasPrefix(b[from:], []byte("null")) {
			return from + 4
		}
		c.logprobs = make([]float64, 0, 64)
		return elements(b, from, func(from int) int {
			if b[from] != '{' {
				return -1
			}
			var lp []byte
			to := members(b, from, func(key []byte, from int) int {
				switch matchKey(key, "logprob") {
				case keyUnusual:
					return -1
				case keyOther:
					return skipValue(b, from)
				}
				if lp != nil {
					return -1
				}
				to := skipValue(b, from)
				lp = b[from:to]
				return to
			})
			if to < 0 {
				return -1
			}
			if lp == nil || string(lp) == "null" {
				c.gap = true
				return to
			}
			f, ok := parseFloat(lp)
			if !ok {
				return -1
			}
			c.logprobs = append(c.logprobs, f)
			return to
		})
	})
	return to, to >= 0
}
