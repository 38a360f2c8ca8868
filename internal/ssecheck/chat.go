package ssecheck

import (
	"encoding/json"
	"errors"
	"fmt"
	"sort"
)

// chatHead are the members every chunk of a stream repeats unchanged.
var chatHead = []string{"id", "created", "model", "system_fingerprint", "service_tier"}

// CheckChat checks a Chat Completions stream: unnamed "data:" events, each
// a chat.completion.chunk with id, object, created, model and choices, the
// repeated members (id, created, model, system_fingerprint, service_tier)
// the same on every chunk; per choice index (0..n-1, each present) a
// first delta with role "assistant", content and refusal strings or null,
// tool_calls deltas each with its index, a call opened (id, type
// "function", function.name, function.arguments "") at the next free index
// before any arguments come for it and never re-opened, and a last chunk
// with an empty delta and a finish_reason after which the choice says
// nothing; with includeUsage, "usage": null on every chunk but a last one
// with no choices and the usage (null only when the completion had
// none), and without it no usage at all; then
// "data: [DONE]" and nothing after it. A stream may instead end with a
// chunk holding an "error" object (with a string message) and no [DONE],
// the way a failure after the headers is reported.
func CheckChat(stream []byte, includeUsage bool) error {
	s, err := Parse(stream)
	if err != nil {
		return err
	}
	_, err = checkChat(s, includeUsage)
	return err
}

// chatChoice is what a stream built of one choice.
type chatChoice struct {
	role, content, refusal string
	hasContent, hasRefusal bool
	calls                  []obj
	args                   []string
	finish                 string
	logprobs               obj
	other                  obj // other choice members, the last value of each
	message                obj // other message members, the last value of each
}

type chatBuild struct {
	top     obj // the first chunk's members, later chunks' assigned over
	choices map[int]*chatChoice
	errObj  obj
}

func checkChat(s *Stream, includeUsage bool) (*chatBuild, error) {
	b := &chatBuild{choices: map[int]*chatChoice{}}
	if len(s.Events) == 0 {
		return nil, errors.New("no chunk")
	}
	var head obj
	usageSeen := false
	for n, ev := range s.Events {
		where := fmt.Sprintf("chunk %d", n)
		if ev.Name != "" {
			return nil, fmt.Errorf("%s: named event %q in a chat stream", where, ev.Name)
		}
		c, err := decode(ev.Data)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", where, err)
		}
		if e, ok := c["error"]; ok {
			if b.errObj, err = errorEvent(e, where, n != len(s.Events)-1 || s.Done); err != nil {
				return nil, err
			}
			return b, nil
		}
		if head == nil {
			head = c
			b.top = obj{}
		}
		if err := checkChunkHead(c, head, where); err != nil {
			return nil, err
		}
		for k, v := range c {
			if k != "choices" {
				b.top[k] = v
			}
		}
		if usageSeen {
			return nil, fmt.Errorf("%s: a chunk after the usage chunk", where)
		}
		choices, ok := c["choices"].([]any)
		if !ok {
			return nil, fmt.Errorf("%s: choices is not a list", where)
		}
		if usageSeen, err = usageChunk(c, choices, includeUsage, n == len(s.Events)-1, where); err != nil {
			return nil, err
		}
		for _, chv := range choices {
			ch, ok := chv.(obj)
			if !ok {
				return nil, fmt.Errorf("%s: a choice is not an object", where)
			}
			if err := b.choice(ch); err != nil {
				return nil, fmt.Errorf("%s: %w", where, err)
			}
		}
	}
	if !s.Done {
		return nil, errors.New("the stream does not end with [DONE]")
	}
	if includeUsage && !usageSeen {
		return nil, errors.New("no usage chunk (include_usage was asked)")
	}
	for i := 0; i < len(b.choices); i++ {
		c, ok := b.choices[i]
		if !ok {
			return nil, fmt.Errorf("choice %d is missing", i)
		}
		if c.finish == "" {
			return nil, fmt.Errorf("choice %d has no finish_reason", i)
		}
	}
	return b, nil
}

// errorEvent checks an error chunk's error (notLast: it is not the
// stream's last event, which it must be).
func errorEvent(e any, where string, notLast bool) (obj, error) {
	eo, ok := e.(obj)
	if !ok {
		return nil, fmt.Errorf("%s: error is not an object", where)
	}
	if _, ok := str(eo, "message"); !ok {
		return nil, fmt.Errorf("%s: error has no message", where)
	}
	if notLast {
		return nil, fmt.Errorf("%s: the error event is not the last of the stream", where)
	}
	return eo, nil
}

// checkChunkHead checks a chunk's id, object, created and model, and that
// the members every chunk repeats are the first chunk's (head's).
func checkChunkHead(c, head obj, where string) error {
	if id, ok := str(c, "id"); !ok || id == "" {
		return fmt.Errorf("%s: no id", where)
	}
	if o, _ := str(c, "object"); o != "chat.completion.chunk" {
		return fmt.Errorf("%s: object is %v", where, c["object"])
	}
	if _, ok := c["created"].(json.Number); !ok {
		return fmt.Errorf("%s: created is not a number", where)
	}
	if _, ok := str(c, "model"); !ok {
		return fmt.Errorf("%s: model is not a string", where)
	}
	for _, k := range chatHead {
		if canon(c[k]) != canon(head[k]) || has(c, k) != has(head, k) {
			return fmt.Errorf("%s: %s is %s, the first chunk's is %s", where, k, canon(c[k]), canon(head[k]))
		}
	}
	return nil
}

// usageChunk checks a chunk's usage member against include_usage; it
// reports whether the chunk is the usage chunk (no choices, the usage;
// null only when the completion had none).
func usageChunk(c obj, choices []any, includeUsage, last bool, where string) (bool, error) {
	u, hasUsage := c["usage"]
	switch {
	case includeUsage && !hasUsage:
		return false, fmt.Errorf("%s: no usage member (include_usage was asked)", where)
	case !includeUsage && u != nil:
		return false, fmt.Errorf("%s: usage %s (include_usage was not asked)", where, canon(u))
	case includeUsage && (u != nil || (len(choices) == 0 && last)):
		if _, ok := u.(obj); !ok && u != nil {
			return false, fmt.Errorf("%s: usage is not an object", where)
		}
		if len(choices) != 0 {
			return false, fmt.Errorf("%s: the usage chunk has choices", where)
		}
		return true, nil
	}
	return false, nil
}

func (b *chatBuild) choice(ch obj) error {
	idx, ok := isInt(ch["index"])
	if !ok {
		return fmt.Errorf("choice index %v", ch["index"])
	}
	delta, ok := ch["delta"].(obj)
	if !ok {
		return fmt.Errorf("choice %d: delta is not an object", idx)
	}
	fr, hasFR := ch["finish_reason"]
	if !hasFR {
		return fmt.Errorf("choice %d: no finish_reason member", idx)
	}
	c := b.choices[idx]
	if c == nil {
		if r, _ := str(delta, "role"); r != "assistant" {
			return fmt.Errorf("choice %d: the first delta's role is %s", idx, canon(delta["role"]))
		}
		c = &chatChoice{other: obj{}, message: obj{}}
		b.choices[idx] = c
	}
	if c.finish != "" {
		return fmt.Errorf("choice %d: a chunk after its finish_reason", idx)
	}
	if fr != nil {
		f, ok := fr.(string)
		if !ok || f == "" {
			return fmt.Errorf("choice %d: finish_reason %s", idx, canon(fr))
		}
		if len(delta) != 0 {
			return fmt.Errorf("choice %d: the finish chunk's delta is %s, not empty", idx, canon(delta))
		}
		c.finish = f
	}
	for k, v := range ch {
		switch k {
		case "index", "delta", "finish_reason":
		case "logprobs":
			if err := c.addLogprobs(idx, v); err != nil {
				return err
			}
		default:
			c.other[k] = v
		}
	}
	return c.addDelta(idx, delta)
}

// addLogprobs adds a chunk's logprobs: the content and refusal lists
// grow, other members are replaced.
func (c *chatChoice) addLogprobs(idx int, v any) error {
	if v == nil {
		return nil
	}
	lp, ok := v.(obj)
	if !ok {
		return fmt.Errorf("choice %d: logprobs is not an object", idx)
	}
	if c.logprobs == nil {
		c.logprobs = obj{}
	}
	for lk, lv := range lp {
		if l, ok := lv.([]any); ok && (lk == "content" || lk == "refusal") {
			prev, _ := c.logprobs[lk].([]any)
			c.logprobs[lk] = append(prev, l...)
		} else {
			c.logprobs[lk] = lv
		}
	}
	return nil
}

// addDelta adds a chunk's delta to the message, as the SDKs accumulate it.
func (c *chatChoice) addDelta(idx int, delta obj) error {
	for k, v := range delta {
		switch k {
		case "role":
			r, ok := v.(string)
			if !ok || (c.role != "" && r != c.role) {
				return fmt.Errorf("choice %d: role %s", idx, canon(v))
			}
			c.role = r
		case "content", "refusal":
			if v == nil {
				continue
			}
			t, ok := v.(string)
			if !ok {
				return fmt.Errorf("choice %d: %s is %s", idx, k, canon(v))
			}
			// As the SDKs do: an empty piece sets nothing.
			if t == "" {
				continue
			}
			if k == "content" {
				c.content += t
				c.hasContent = true
			} else {
				c.refusal += t
				c.hasRefusal = true
			}
		case "tool_calls":
			list, ok := v.([]any)
			if !ok {
				return fmt.Errorf("choice %d: tool_calls is not a list", idx)
			}
			for _, tv := range list {
				tc, ok := tv.(obj)
				if !ok {
					return fmt.Errorf("choice %d: a tool call delta is not an object", idx)
				}
				if err := c.toolCall(idx, tc); err != nil {
					return err
				}
			}
		default:
			c.message[k] = v
		}
	}
	return nil
}

func (c *chatChoice) toolCall(idx int, tc obj) error {
	j, ok := isInt(tc["index"])
	if !ok {
		return fmt.Errorf("choice %d: tool call delta without an index: %s", idx, canon(tc))
	}
	switch {
	case j == len(c.calls):
		id, _ := str(tc, "id")
		typ, _ := str(tc, "type")
		if id == "" || typ == "" {
			return fmt.Errorf("choice %d: tool call %d opens without id and type: %s", idx, j, canon(tc))
		}
		call := obj{}
		for k, v := range tc {
			if k != "index" && k != "function" {
				call[k] = v
			}
		}
		args := ""
		if typ == "function" {
			fn, ok := tc["function"].(obj)
			if !ok {
				return fmt.Errorf("choice %d: function tool call %d opens without function", idx, j)
			}
			if name, _ := str(fn, "name"); name == "" {
				return fmt.Errorf("choice %d: tool call %d opens without function.name", idx, j)
			}
			a, ok := str(fn, "arguments")
			if !ok || a != "" {
				return fmt.Errorf(`choice %d: tool call %d opens with arguments %s, not ""`, idx, j, canon(fn["arguments"]))
			}
			f := obj{}
			for k, v := range fn {
				f[k] = v
			}
			call["function"] = f
		}
		c.calls = append(c.calls, call)
		c.args = append(c.args, args)
	case j < len(c.calls):
		if has(tc, "id") || has(tc, "type") {
			return fmt.Errorf("choice %d: tool call %d opened again: %s", idx, j, canon(tc))
		}
		fn, ok := tc["function"].(obj)
		if !ok {
			return fmt.Errorf("choice %d: tool call %d delta without function", idx, j)
		}
		for k, v := range fn {
			if k != "arguments" {
				return fmt.Errorf("choice %d: tool call %d delta sets function.%s", idx, j, k)
			}
			a, ok := v.(string)
			if !ok {
				return fmt.Errorf("choice %d: tool call %d arguments %s", idx, j, canon(v))
			}
			c.args[j] += a
		}
	default:
		return fmt.Errorf("choice %d: tool call index %d skips %d", idx, j, len(c.calls))
	}
	return nil
}

// AccumulateChat checks a Chat Completions stream as CheckChat does (with
// include_usage as the stream shows it) and rebuilds the chat.completion
// it stands for the way the SDKs do: the first chunk's members with later
// chunks' assigned over them (object becomes "chat.completion"), per
// choice the message from the deltas (content and refusal concatenated,
// null when no piece was sent; tool calls opened and their arguments
// concatenated; other message members the last value), logprobs content
// concatenated, the finish_reason, and the choice's other members. A
// stream ending in an error event is an error holding its message.
func AccumulateChat(stream []byte) ([]byte, error) {
	s, err := Parse(stream)
	if err != nil {
		return nil, err
	}
	includeUsage := false
	if len(s.Events) > 0 {
		if c, err := decode(s.Events[0].Data); err == nil {
			_, includeUsage = c["usage"]
		}
	}
	b, err := checkChat(s, includeUsage)
	if err != nil {
		return nil, err
	}
	if b.errObj != nil {
		m, _ := str(b.errObj, "message")
		return nil, fmt.Errorf("the stream ended with an error: %s", m)
	}
	out := obj{}
	for k, v := range b.top {
		out[k] = v
	}
	out["object"] = "chat.completion"
	idx := make([]int, 0, len(b.choices))
	for i := range b.choices {
		idx = append(idx, i)
	}
	sort.Ints(idx)
	choices := []any{}
	for _, i := range idx {
		c := b.choices[i]
		msg := obj{}
		for k, v := range c.message {
			msg[k] = v
		}
		msg["role"] = c.role
		msg["content"], msg["refusal"] = nil, nil
		if c.hasContent {
			msg["content"] = c.content
		}
		if c.hasRefusal {
			msg["refusal"] = c.refusal
		}
		if len(c.calls) > 0 {
			calls := make([]any, len(c.calls))
			for j, call := range c.calls {
				if fn, ok := call["function"].(obj); ok {
					fn["arguments"] = c.args[j]
				}
				calls[j] = call
			}
			msg["tool_calls"] = calls
		}
		ch := obj{}
		for k, v := range c.other {
			ch[k] = v
		}
		ch["index"] = i
		ch["message"] = msg
		ch["finish_reason"] = c.finish
		ch["logprobs"] = nil
		if c.logprobs != nil {
			ch["logprobs"] = c.logprobs
		}
		choices = append(choices, ch)
	}
	out["choices"] = choices
	return json.Marshal(out)
}

// SameChat reports how an accumulated chat completion differs from the
// non-streamed one it should equal, nil when it does not: compared as JSON
// values after giving both the forms the stream cannot tell apart (a
// message's content "" and null, an absent refusal and null, an absent
// logprobs and null, object "chat.completion"; with wantUsage false, the
// non-streamed usage dropped).
func SameChat(accumulated, want []byte, wantUsage bool) error {
	a, err := decode(accumulated)
	if err != nil {
		return fmt.Errorf("accumulated: %w", err)
	}
	w, err := decode(want)
	if err != nil {
		return fmt.Errorf("want: %w", err)
	}
	for _, o := range []obj{a, w} {
		o["object"] = "chat.completion"
		if !wantUsage {
			delete(o, "usage")
		}
		chs, _ := o["choices"].([]any)
		for _, chv := range chs {
			ch, ok := chv.(obj)
			if !ok {
				continue
			}
			if ch["logprobs"] == nil {
				ch["logprobs"] = nil
			}
			if m, ok := ch["message"].(obj); ok {
				if m["content"] == "" {
					m["content"] = nil
				}
				if !has(m, "content") {
					m["content"] = nil
				}
				if !has(m, "refusal") {
					m["refusal"] = nil
				}
			}
		}
	}
	if ca, cw := canon(a), canon(w); ca != cw {
		return fmt.Errorf("accumulated %s\n           want %s", ca, cw)
	}
	return nil
}
