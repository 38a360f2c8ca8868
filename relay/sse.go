package relay

import (
	"bufio"
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"sort"
	"strings"
)

// Event is one server-sent event.
type Event struct {
	Name string // the "event:" field; empty for the default
	Data []byte // the "data:" lines joined with newlines
}

// MaxEventBytes bounds one event's data.
const MaxEventBytes = 16 << 20

// ParseSSE reads a text/event-stream body into its events, up to and not
// including a "[DONE]" data line. Comments and unknown fields are ignored.
func ParseSSE(r io.Reader) ([]Event, error) {
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 64<<10), MaxEventBytes)
	var out []Event
	var cur Event
	var data [][]byte
	has := false
	flush := func() {
		if has {
			cur.Data = bytes.Join(data, []byte("\n"))
			out = append(out, cur)
		}
		cur, data, has = Event{}, nil, false
	}
	for sc.Scan() {
		line := sc.Bytes()
		if len(line) == 0 {
			flush()
			continue
		}
		if line[0] == ':' {
			continue
		}
		field, value, _ := bytes.Cut(line, []byte(":"))
		value = bytes.TrimPrefix(value, []byte(" "))
		switch string(field) {
		case "event":
			cur.Name = string(value)
			has = true
		case "data":
			if bytes.Equal(value, []byte("[DONE]")) {
				flush()
				return out, nil
			}
			data = append(data, append([]byte(nil), value...))
			has = true
		}
	}
	if err := sc.Err(); err != nil {
		return out, fmt.Errorf("read event stream: %w", err)
	}
	flush()
	return out, nil
}

// obj is a JSON object whose fields keep their raw values, so fields this
// package does not know pass through untouched.
type obj map[string]json.RawMessage

func decodeObj(b []byte) (obj, error) {
	var o obj
	if err := json.Unmarshal(b, &o); err != nil {
		return nil, err
	}
	if o == nil {
		return nil, errors.New("not a JSON object")
	}
	return o, nil
}

func (o obj) str(k string) string {
	var s string
	_ = json.Unmarshal(o[k], &s)
	return s
}

func raw(v any) json.RawMessage {
	b, _ := json.Marshal(v)
	return b
}

// AssembleChat merges chat.completion.chunk events into one chat.completion
// object: content and tool-call arguments are concatenated, the last
// finish_reason and usage win, and other fields of the first chunk are
// kept.
func AssembleChat(events []Event) ([]byte, error) {
	var (
		top      obj
		content  strings.Builder
		role     = "assistant"
		finish   json.RawMessage
		usage    json.RawMessage
		calls    = map[int]obj{}
		args     = map[int]*strings.Builder{}
		extras   = obj{}
		anyDelta bool
	)
	for _, ev := range events {
		c, err := decodeObj(ev.Data)
		if err != nil {
			return nil, fmt.Errorf("stream chunk: %w", err)
		}
		if top == nil {
			top = obj{}
			for k, v := range c {
				if k != "choices" && k != "usage" {
					top[k] = v
				}
			}
		}
		if u, ok := c["usage"]; ok && string(u) != "null" {
			usage = u
		}
		var choices []obj
		_ = json.Unmarshal(c["choices"], &choices)
		for _, ch := range choices {
			for k, v := range ch {
				if k != "delta" && k != "index" && k != "finish_reason" {
					extras[k] = v
				}
			}
			if f, ok := ch["finish_reason"]; ok && string(f) != "null" {
				finish = f
			}
			delta, err := decodeObj(ch["delta"])
			if err != nil {
				continue
			}
			anyDelta = true
			if r := delta.str("role"); r != "" {
				role = r
			}
			var s string
			if json.Unmarshal(delta["content"], &s) == nil {
				content.WriteString(s)
			}
			var tcs []obj
			_ = json.Unmarshal(delta["tool_calls"], &tcs)
			for i, tc := range tcs {
				idx := i
				_ = json.Unmarshal(tc["index"], &idx)
				cur, ok := calls[idx]
				if !ok {
					cur = obj{}
					calls[idx] = cur
					args[idx] = &strings.Builder{}
				}
				for _, k := range []string{"id", "type"} {
					if v, ok := tc[k]; ok {
						cur[k] = v
					}
				}
				if fn, err := decodeObj(tc["function"]); err == nil {
					if n, ok := fn["name"]; ok {
						cur["name"] = n
					}
					var a string
					if json.Unmarshal(fn["arguments"], &a) == nil {
						args[idx].WriteString(a)
					}
				}
			}
		}
	}
	if top == nil || !anyDelta {
		return nil, errors.New("stream held no chat completion chunk")
	}
	msg := obj{"role": raw(role)}
	if content.Len() > 0 || len(calls) == 0 {
		msg["content"] = raw(content.String())
	}
	if len(calls) > 0 {
		idx := make([]int, 0, len(calls))
		for i := range calls {
			idx = append(idx, i)
		}
		sort.Ints(idx)
		var list []obj
		for _, i := range idx {
			c := calls[i]
			t := c["type"]
			if t == nil {
				t = raw("function")
			}
			tc := obj{"id": c["id"], "type": t, "function": raw(obj{"name": c["name"], "arguments": raw(args[i].String())})}
			list = append(list, tc)
		}
		msg["tool_calls"] = raw(list)
	}
	if finish == nil {
		finish = raw("stop")
	}
	choice := obj{"index": raw(0), "message": raw(msg), "finish_reason": finish}
	for k, v := range extras {
		choice[k] = v
	}
	top["object"] = raw("chat.completion")
	top["choices"] = raw([]obj{choice})
	if usage != nil {
		top["usage"] = usage
	}
	return json.Marshal(top)
}

// ChatChunks turns a whole chat.completion into the SSE body a streaming
// client expects: one chunk carrying the message as a delta (with every
// field of the completion and of its choice that is not the message), a
// chunk with the finish reason, a usage chunk when asked, and [DONE].
func ChatChunks(completion []byte, includeUsage bool) ([]byte, error) {
	c, err := decodeObj(completion)
	if err != nil {
		return nil, fmt.Errorf("completion: %w", err)
	}
	var choices []obj
	if err := json.Unmarshal(c["choices"], &choices); err != nil {
		return nil, fmt.Errorf("completion choices: %w", err)
	}
	head := obj{}
	for k, v := range c {
		if k != "choices" && k != "usage" && k != "object" {
			head[k] = v
		}
	}
	head["object"] = raw("chat.completion.chunk")
	var buf bytes.Buffer
	emit := func(o obj) {
		b, _ := json.Marshal(o)
		buf.WriteString("data: ")
		buf.Write(b)
		buf.WriteString("\n\n")
	}
	var first, last []obj
	for i, ch := range choices {
		msg, _ := decodeObj(ch["message"])
		delta := obj{}
		for k, v := range msg {
			delta[k] = v
		}
		if tcs, ok := msg["tool_calls"]; ok {
			var list []obj
			_ = json.Unmarshal(tcs, &list)
			for j := range list {
				list[j]["index"] = raw(j)
			}
			delta["tool_calls"] = raw(list)
		}
		one := obj{"index": raw(i), "delta": raw(delta), "finish_reason": raw(nil)}
		for k, v := range ch {
			if k != "message" && k != "index" && k != "finish_reason" {
				one[k] = v
			}
		}
		first = append(first, one)
		fr := ch["finish_reason"]
		if fr == nil {
			fr = raw("stop")
		}
		last = append(last, obj{"index": raw(i), "delta": raw(obj{}), "finish_reason": fr})
	}
	o := obj{}
	for k, v := range head {
		o[k] = v
	}
	o["choices"] = raw(first)
	emit(o)
	o2 := obj{}
	for _, k := range []string{"id", "object", "created", "model", "system_fingerprint"} {
		if v, ok := head[k]; ok {
			o2[k] = v
		}
	}
	o2["choices"] = raw(last)
	emit(o2)
	if u, ok := c["usage"]; ok && includeUsage {
		o3 := obj{}
		for _, k := range []string{"id", "object", "created", "model"} {
			if v, ok := head[k]; ok {
				o3[k] = v
			}
		}
		o3["choices"] = raw([]obj{})
		o3["usage"] = u
		emit(o3)
	}
	buf.WriteString("data: [DONE]\n\n")
	return buf.Bytes(), nil
}

// ResponsesEvents turns a whole Responses-API response object into the SSE
// events a streaming client expects, ending with response.completed.
func ResponsesEvents(response []byte) ([]byte, error) {
	r, err := decodeObj(response)
	if err != nil {
		return nil, fmt.Errorf("response: %w", err)
	}
	var buf bytes.Buffer
	seq := 0
	emit := func(name string, o obj) {
		o["type"] = raw(name)
		o["sequence_number"] = raw(seq)
		seq++
		b, _ := json.Marshal(o)
		fmt.Fprintf(&buf, "event: %s\ndata: %s\n\n", name, b)
	}
	inProgress := obj{}
	for k, v := range r {
		inProgress[k] = v
	}
	inProgress["status"] = raw("in_progress")
	inProgress["output"] = raw([]any{})
	emit("response.created", obj{"response": raw(inProgress)})
	var items []obj
	_ = json.Unmarshal(r["output"], &items)
	for i, it := range items {
		emit("response.output_item.added", obj{"output_index": raw(i), "item": raw(it)})
		if it.str("type") == "message" {
			var parts []obj
			_ = json.Unmarshal(it["content"], &parts)
			for j, p := range parts {
				if p.str("type") == "output_text" {
					emit("response.output_text.delta", obj{"item_id": it["id"], "output_index": raw(i), "content_index": raw(j), "delta": p["text"]})
					emit("response.output_text.done", obj{"item_id": it["id"], "output_index": raw(i), "content_index": raw(j), "text": p["text"]})
				}
			}
		}
		emit("response.output_item.done", obj{"output_index": raw(i), "item": raw(it)})
	}
	emit("response.completed", obj{"response": raw(r)})
	return buf.Bytes(), nil
}
