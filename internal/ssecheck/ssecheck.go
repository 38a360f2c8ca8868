// Package ssecheck owns checking server-sent event streams against the
// OpenAI streaming formats: the Chat Completions chunk grammar
// (CheckChat) and the Responses streaming event grammar
// (CheckResponses), and rebuilding the final object from a stream the way
// a client SDK does, from the deltas only (AccumulateChat,
// AccumulateResponses), so tests can hold a stream to the non-streamed
// object it stands for. It is a leaf: it imports nothing of stasis.
package ssecheck

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"reflect"
	"strings"
)

// Event is one server-sent event.
type Event struct {
	Name string // the "event:" field; empty for the default
	Data []byte // the "data:" lines joined with newlines
}

// Stream is a parsed event stream.
type Stream struct {
	Events []Event // the events before "data: [DONE]"
	Done   bool    // whether the stream ended with "data: [DONE]"
}

// Parse reads a text/event-stream body. It refuses anything after a
// "data: [DONE]" event other than blank lines and comments, and a last
// event not closed by a blank line. It is written apart from the relay's
// own parser (relay.ParseSSE, lenient as a client must be), so that the
// checker and the code it checks cannot share a mistake.
func Parse(stream []byte) (*Stream, error) {
	var s Stream
	var cur Event
	var data [][]byte
	has := false
	text := strings.ReplaceAll(string(stream), "\r\n", "\n")
	lines := strings.Split(text, "\n")
	if lines[len(lines)-1] != "" {
		return nil, errors.New("the stream does not end with a newline")
	}
	lines = lines[:len(lines)-1]
	for n, line := range lines {
		if line == "" {
			if has {
				cur.Data = bytes.Join(data, []byte("\n"))
				if s.Done {
					return nil, fmt.Errorf("line %d: an event after [DONE]", n+1)
				}
				if string(cur.Data) == "[DONE]" {
					if cur.Name != "" {
						return nil, fmt.Errorf("line %d: [DONE] in a named event", n+1)
					}
					s.Done = true
				} else {
					s.Events = append(s.Events, cur)
				}
			}
			cur, data, has = Event{}, nil, false
			continue
		}
		if line[0] == ':' {
			continue
		}
		field, value, _ := strings.Cut(line, ":")
		value = strings.TrimPrefix(value, " ")
		switch field {
		case "event":
			cur.Name = value
		case "data":
			data = append(data, []byte(value))
		default:
			return nil, fmt.Errorf("line %d: unexpected field %q", n+1, field)
		}
		has = true
	}
	if has {
		return nil, errors.New("the last event is not closed by a blank line")
	}
	return &s, nil
}

// obj is a decoded JSON object.
type obj = map[string]any

func decode(b []byte) (obj, error) {
	d := json.NewDecoder(bytes.NewReader(b))
	d.UseNumber()
	var v any
	if err := d.Decode(&v); err != nil {
		return nil, err
	}
	if d.More() {
		return nil, errors.New("more than one JSON value")
	}
	o, ok := v.(obj)
	if !ok {
		return nil, errors.New("not a JSON object")
	}
	return o, nil
}

func isInt(v any) (int, bool) {
	n, ok := v.(json.Number)
	if !ok {
		return 0, false
	}
	i, err := n.Int64()
	if err != nil || i < 0 || i > 1<<31 {
		return 0, false
	}
	return int(i), true
}

func str(o obj, k string) (string, bool) {
	s, ok := o[k].(string)
	return s, ok
}

func has(o obj, k string) bool { _, ok := o[k]; return ok }

func canon(v any) string {
	b, _ := json.Marshal(v)
	return string(b)
}

// deepCopy copies a decoded JSON value.
func deepCopy(v any) any {
	switch t := v.(type) {
	case obj:
		c := make(obj, len(t))
		for k, x := range t {
			c[k] = deepCopy(x)
		}
		return c
	case []any:
		c := make([]any, len(t))
		for i, x := range t {
			c[i] = deepCopy(x)
		}
		return c
	}
	return v
}

// Equal reports whether two JSON texts hold the same value.
func Equal(a, b []byte) bool {
	x, err1 := decodeAny(a)
	y, err2 := decodeAny(b)
	return err1 == nil && err2 == nil && reflect.DeepEqual(x, y)
}

func decodeAny(b []byte) (any, error) {
	var v any
	err := json.Unmarshal(b, &v)
	return v, err
}
