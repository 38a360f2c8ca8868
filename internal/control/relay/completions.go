package relay

import (
	"bytes"
	"encoding/json"
	"fmt"
)

// CompletionChunks turns a whole legacy completion (POST /v1/completions,
// object "text_completion") into the SSE body a streaming client expects:
// per choice a chunk with its text (and logprobs) and finish_reason null,
// then a chunk per choice with empty text and its finish_reason, a usage
// chunk with no choices when asked, and [DONE]. Every chunk keeps the
// completion's id, object, created, model and system_fingerprint.
func CompletionChunks(completion []byte, includeUsage bool) ([]byte, error) {
	c, err := decodeObj(completion)
	if err != nil {
		return nil, fmt.Errorf("completion: %w", err)
	}
	var choices []obj
	if err := json.Unmarshal(c["choices"], &choices); err != nil {
		return nil, fmt.Errorf("completion choices: %w", err)
	}
	head := obj{}
	for _, k := range []string{"id", "object", "created", "model", "system_fingerprint"} {
		if v, ok := c[k]; ok {
			head[k] = v
		}
	}
	if _, ok := head["object"]; !ok {
		head["object"] = raw("text_completion")
	}
	var buf bytes.Buffer
	emit := func(choices []obj, usage json.RawMessage) {
		o := obj{}
		for k, v := range head {
			o[k] = v
		}
		o["choices"] = raw(choices)
		if includeUsage {
			o["usage"] = raw(nil)
			if usage != nil {
				o["usage"] = usage
			}
		}
		b, _ := json.Marshal(o)
		buf.WriteString("data: ")
		buf.Write(b)
		buf.WriteString("\n\n")
	}
	for i, ch := range choices {
		idx := ch["index"]
		if idx == nil {
			idx = raw(i)
		}
		one := obj{"index": idx, "text": raw(""), "logprobs": raw(nil), "finish_reason": raw(nil)}
		for k, v := range ch {
			if k != "finish_reason" {
				one[k] = v
			}
		}
		emit([]obj{one}, nil)
	}
	for i, ch := range choices {
		idx := ch["index"]
		if idx == nil {
			idx = raw(i)
		}
		fr := ch["finish_reason"]
		if fr == nil {
			fr = raw("stop")
		}
		emit([]obj{{"index": idx, "text": raw(""), "logprobs": raw(nil), "finish_reason": fr}}, nil)
	}
	if u, ok := c["usage"]; ok && includeUsage {
		emit([]obj{}, u)
	}
	buf.WriteString("data: [DONE]\n\n")
	return buf.Bytes(), nil
}
