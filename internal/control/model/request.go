package model

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
)

// ChatRequest is the part of an OpenAI chat-completions request the
// scripted model reads. Unknown fields are ignored.
type ChatRequest struct {
	Model         string         `json:"model"`
	Messages      []Message      `json:"messages"`
	Tools         []Tool         `json:"tools,omitempty"`
	ToolChoice    any            `json:"tool_choice,omitempty"`
	Stream        bool           `json:"stream,omitempty"`
	StreamOptions *StreamOptions `json:"stream_options,omitempty"`
	TopLogprobs   int            `json:"top_logprobs,omitempty"`
}

// StreamOptions is a chat request's stream_options.
type StreamOptions struct {
	IncludeUsage bool `json:"include_usage"`
}

// Message is one chat message. Content is kept as sent: a string, null, or a
// list of content parts.
type Message struct {
	Role       string          `json:"role"`
	Content    json.RawMessage `json:"content,omitempty"`
	Name       string          `json:"name,omitempty"`
	ToolCalls  []ToolCall      `json:"tool_calls,omitempty"`
	ToolCallID string          `json:"tool_call_id,omitempty"`
}

// ToolCall is an OpenAI tool call, in a request's assistant message or in a
// response.
type ToolCall struct {
	Index    *int         `json:"index,omitempty"`
	ID       string       `json:"id,omitempty"`
	Type     string       `json:"type,omitempty"`
	Function FunctionCall `json:"function"`
}

// FunctionCall is the function of a tool call; Arguments is JSON text.
type FunctionCall struct {
	Name      string `json:"name,omitempty"`
	Arguments string `json:"arguments"`
}

// Tool is one tool a chat request offers.
type Tool struct {
	Type     string          `json:"type"`
	Function json.RawMessage `json:"function"`
}

// ParseChatRequest decodes and checks a chat-completions request body.
func ParseChatRequest(body []byte) (*ChatRequest, error) {
	var r ChatRequest
	if err := json.Unmarshal(body, &r); err != nil {
		return nil, fmt.Errorf("the request body is not a valid chat-completions JSON object: %w", err)
	}
	if len(r.Messages) == 0 {
		return nil, errors.New(`"messages" is missing or empty: send at least one message`)
	}
	for i, m := range r.Messages {
		if m.Role == "" {
			return nil, fmt.Errorf(`messages[%d]: "role" is missing`, i)
		}
		if _, err := contentText(m.Content); err != nil {
			return nil, fmt.Errorf("messages[%d].content: %w", i, err)
		}
	}
	if r.TopLogprobs < 0 || r.TopLogprobs > 20 {
		return nil, fmt.Errorf(`"top_logprobs" is %d: give 0 to 20`, r.TopLogprobs)
	}
	return &r, nil
}

// contentText flattens message content: a string, null, or a list of parts
// whose text parts are joined; other parts (images, files) become a marker.
func contentText(raw json.RawMessage) (string, error) {
	raw = bytes.TrimSpace(raw)
	if len(raw) == 0 || bytes.Equal(raw, []byte("null")) {
		return "", nil
	}
	switch raw[0] {
	case '"':
		var s string
		err := json.Unmarshal(raw, &s)
		return s, err
	case '[':
		var parts []struct {
			Type string `json:"type"`
			Text string `json:"text"`
		}
		if err := json.Unmarshal(raw, &parts); err != nil {
			return "", fmt.Errorf("content parts: %w", err)
		}
		var b strings.Builder
		for _, p := range parts {
			switch p.Type {
			case "text", "input_text", "output_text", "":
				b.WriteString(p.Text)
			default:
				b.WriteString("[" + p.Type + "]")
			}
		}
		return b.String(), nil
	}
	return "", errors.New("content must be a string, null, or a list of content parts")
}

// toolName is the function name of a chat tool ("" when it has none).
func (t Tool) toolName() string {
	var f struct {
		Name string `json:"name"`
	}
	_ = json.Unmarshal(t.Function, &f)
	return f.Name
}

// toolsDisabled reports whether tool_choice forbids tool calls.
func toolsDisabled(choice any) bool {
	s, ok := choice.(string)
	return ok && s == "none"
}

// conversation is a request of either API, reduced to what the script and
// the tokenizer need.
type conversation struct {
	messages    []convMessage
	tools       []string // offered tool names, in order
	toolsJSON   []string // each offered tool as compact JSON, for the prompt
	assistant   int      // assistant turns already in the request
	topLogprobs int
}

type convMessage struct {
	role    string
	content string
	calls   []genCall
}

func (r *ChatRequest) conversation() *conversation {
	c := &conversation{topLogprobs: r.TopLogprobs}
	if !toolsDisabled(r.ToolChoice) {
		for _, t := range r.Tools {
			if n := t.toolName(); n != "" {
				c.tools = append(c.tools, n)
				c.toolsJSON = append(c.toolsJSON, compactJSON(t.Function))
			}
		}
	}
	for _, m := range r.Messages {
		text, _ := contentText(m.Content)
		cm := convMessage{role: m.Role, content: text}
		for _, tc := range m.ToolCalls {
			cm.calls = append(cm.calls, genCall{name: tc.Function.Name, args: tc.Function.Arguments})
		}
		if m.Role == "assistant" {
			c.assistant++
		}
		c.messages = append(c.messages, cm)
	}
	return c
}

func compactJSON(raw json.RawMessage) string {
	var b bytes.Buffer
	if json.Compact(&b, raw) != nil {
		return string(raw)
	}
	return b.String()
}
