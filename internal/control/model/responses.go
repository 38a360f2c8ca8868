package model

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
)

// ResponsesRequest is the part of an OpenAI responses request the scripted
// model reads. previous_response_id is not supported: the server keeps no
// state, so send the whole conversation in input.
type ResponsesRequest struct {
	Model        string            `json:"model"`
	Input        json.RawMessage   `json:"input"`
	Instructions string            `json:"instructions,omitempty"`
	Tools        []json.RawMessage `json:"tools,omitempty"`
	ToolChoice   any               `json:"tool_choice,omitempty"`
	Stream       bool              `json:"stream,omitempty"`
	TopLogprobs  int               `json:"top_logprobs,omitempty"`
}

// inputItem is one item of a responses input list.
type inputItem struct {
	Type      string          `json:"type"`
	Role      string          `json:"role"`
	Content   json.RawMessage `json:"content"`
	CallID    string          `json:"call_id"`
	Name      string          `json:"name"`
	Arguments string          `json:"arguments"`
	Output    json.RawMessage `json:"output"`
}

// ParseResponsesRequest decodes a responses request body into its
// conversation.
func ParseResponsesRequest(body []byte) (*ResponsesRequest, error) {
	var r ResponsesRequest
	if err := json.Unmarshal(body, &r); err != nil {
		return nil, fmt.Errorf("the request body is not a valid responses JSON object: %w", err)
	}
	if _, err := r.conversation(); err != nil {
		return nil, err
	}
	if r.TopLogprobs < 0 || r.TopLogprobs > 20 {
		return nil, fmt.Errorf(`"top_logprobs" is %d: give 0 to 20`, r.TopLogprobs)
	}
	return &r, nil
}

func (r *ResponsesRequest) conversation() (*conversation, error) {
	c := &conversation{topLogprobs: r.TopLogprobs}
	if !toolsDisabled(r.ToolChoice) {
		for _, raw := range r.Tools {
			var t struct {
				Type string `json:"type"`
				Name string `json:"name"`
			}
			if json.Unmarshal(raw, &t) == nil && t.Type == "function" && t.Name != "" {
				c.tools = append(c.tools, t.Name)
				c.toolsJSON = append(c.toolsJSON, compactJSON(raw))
			}
		}
	}
	if r.Instructions != "" {
		c.messages = append(c.messages, convMessage{role: "system", content: r.Instructions})
	}
	in := bytes.TrimSpace(r.Input)
	switch {
	case len(in) == 0 || bytes.Equal(in, []byte("null")):
		return nil, errors.New(`"input" is missing: send a string or a list of input items`)
	case in[0] == '"':
		var s string
		if err := json.Unmarshal(in, &s); err != nil {
			return nil, fmt.Errorf("input: %w", err)
		}
		c.messages = append(c.messages, convMessage{role: "user", content: s})
		return c, nil
	case in[0] != '[':
		return nil, errors.New(`"input" must be a string or a list of input items`)
	}
	var items []inputItem
	if err := json.Unmarshal(in, &items); err != nil {
		return nil, fmt.Errorf("input: %w", err)
	}
	if err := c.addItems(items); err != nil {
		return nil, err
	}
	if len(c.messages) == 0 {
		return nil, errors.New(`"input" is empty: send at least one item`)
	}
	return c, nil
}

// addItems adds the conversation's input items. Consecutive assistant
// items (text, function calls, reasoning) are one assistant turn.
func (c *conversation) addItems(items []inputItem) error {
	inAssistant := false
	assistant := func() *convMessage {
		if !inAssistant {
			c.assistant++
			c.messages = append(c.messages, convMessage{role: "assistant"})
			inAssistant = true
		}
		return &c.messages[len(c.messages)-1]
	}
	for i, it := range items {
		typ := it.Type
		if typ == "" {
			typ = "message"
		}
		switch typ {
		case "message":
			text, err := contentText(it.Content)
			if err != nil {
				return fmt.Errorf("input[%d].content: %w", i, err)
			}
			if it.Role == "" {
				return fmt.Errorf(`input[%d]: "role" is missing`, i)
			}
			if it.Role == "assistant" {
				assistant().content += text
				continue
			}
			inAssistant = false
			c.messages = append(c.messages, convMessage{role: it.Role, content: text})
		case "function_call", "reasoning":
			m := assistant()
			if typ == "function_call" {
				m.calls = append(m.calls, genCall{name: it.Name, args: it.Arguments})
			}
		case "function_call_output":
			inAssistant = false
			text, err := outputText(it.Output)
			if err != nil {
				return fmt.Errorf("input[%d].output: %w", i, err)
			}
			c.messages = append(c.messages, convMessage{role: "tool", content: text})
		default:
			inAssistant = false
			c.messages = append(c.messages, convMessage{role: typ})
		}
	}
	return nil
}

func outputText(raw json.RawMessage) (string, error) {
	raw = bytes.TrimSpace(raw)
	if len(raw) > 0 && raw[0] != '"' && raw[0] != '[' && !bytes.Equal(raw, []byte("null")) {
		return compactJSON(raw), nil
	}
	return contentText(raw)
}

// Response is a responses-API response object, with the token ids of the
// prompt and of the output as top-level extensions.
type Response struct {
	ID                string          `json:"id"`
	Object            string          `json:"object"`
	CreatedAt         int64           `json:"created_at"`
	Status            string          `json:"status"`
	Model             string          `json:"model"`
	Output            []any           `json:"output"`
	ParallelToolCalls bool            `json:"parallel_tool_calls"`
	ToolChoice        any             `json:"tool_choice"`
	Tools             []any           `json:"tools"`
	Error             any             `json:"error"`
	IncompleteDetails any             `json:"incomplete_details"`
	Usage             *ResponsesUsage `json:"usage"`
	PromptTokenIDs    []int64         `json:"prompt_token_ids,omitempty"`
	TokenIDs          []int64         `json:"token_ids,omitempty"`
}

// ResponsesUsage counts tokens the responses-API way.
type ResponsesUsage struct {
	InputTokens        int `json:"input_tokens"`
	InputTokensDetails struct {
		CachedTokens int `json:"cached_tokens"`
	} `json:"input_tokens_details"`
	OutputTokens        int `json:"output_tokens"`
	OutputTokensDetails struct {
		ReasoningTokens int `json:"reasoning_tokens"`
	} `json:"output_tokens_details"`
	TotalTokens int `json:"total_tokens"`
}

// MessageItem is an output message.
type MessageItem struct {
	Type    string          `json:"type"`
	ID      string          `json:"id"`
	Status  string          `json:"status"`
	Role    string          `json:"role"`
	Content []OutputContent `json:"content"`
}

// OutputContent is one content part of a MessageItem.
type OutputContent struct {
	Type        string         `json:"type"`
	Text        string         `json:"text"`
	Annotations []any          `json:"annotations"`
	Logprobs    []LogprobEntry `json:"logprobs"`
}

// FunctionCallItem is an output function call.
type FunctionCallItem struct {
	Type      string `json:"type"`
	ID        string `json:"id"`
	CallID    string `json:"call_id"`
	Name      string `json:"name"`
	Arguments string `json:"arguments"`
	Status    string `json:"status"`
}

func (s *Server) serveResponses(w http.ResponseWriter, r *http.Request) {
	body, req, ok := readRequest(s, w, r, ParseResponsesRequest)
	if !ok {
		return
	}
	conv, _ := req.conversation()
	s.answer(w, r, call{
		api: "responses", logMsg: "response", body: body, conv: conv, model: req.Model, stream: req.Stream,
		events: func(g *generation, model string) []event {
			return (&responseBuilder{g: g, model: model, created: s.created}).events()
		},
		whole: func(g *generation, model string) any {
			return (&responseBuilder{g: g, model: model, created: s.created}).response("completed", true)
		},
	})
}

type responseBuilder struct {
	g       *generation
	model   string
	created int64
}

func (b *responseBuilder) msgID() string { return "msg_" + subID(b.g.key, "msg", 0) }

func (b *responseBuilder) fcID(i int) string { return "fc_" + subID(b.g.key, "fc", i) }

// contentLogprobs are the logprobs of the text pieces.
func (b *responseBuilder) contentLogprobs() []LogprobEntry {
	out := []LogprobEntry{}
	for _, p := range b.g.pieces {
		if p.kind == pieceContent {
			out = append(out, b.g.logprobEntries(p.from, p.n)...)
		}
	}
	return out
}

func (b *responseBuilder) message(status string, text string, lps []LogprobEntry) MessageItem {
	m := MessageItem{Type: "message", ID: b.msgID(), Status: status, Role: "assistant", Content: []OutputContent{}}
	if status == "completed" {
		m.Content = []OutputContent{{Type: "output_text", Text: text, Annotations: []any{}, Logprobs: lps}}
	}
	return m
}

func (b *responseBuilder) call(i int, status, args string) FunctionCallItem {
	c := b.g.calls[i]
	return FunctionCallItem{Type: "function_call", ID: b.fcID(i), CallID: c.id, Name: c.name, Arguments: args, Status: status}
}

func (b *responseBuilder) hasMessage() bool { return b.g.content != "" || len(b.g.calls) == 0 }

func (b *responseBuilder) response(status string, full bool) *Response {
	g := b.g
	r := &Response{
		ID: "resp_" + g.id, Object: "response", CreatedAt: b.created, Status: status, Model: b.model,
		Output: []any{}, ParallelToolCalls: true, ToolChoice: "auto", Tools: []any{},
	}
	if !full {
		return r
	}
	if b.hasMessage() {
		r.Output = append(r.Output, b.message("completed", g.content, b.contentLogprobs()))
	}
	for i, c := range g.calls {
		r.Output = append(r.Output, b.call(i, "completed", c.args))
	}
	u := &ResponsesUsage{InputTokens: len(g.promptIDs), OutputTokens: len(g.ids), TotalTokens: len(g.promptIDs) + len(g.ids)}
	r.Usage = u
	r.PromptTokenIDs = g.promptIDs
	r.TokenIDs = g.ids
	return r
}

// events prepares a responses stream: created, in_progress, the message's
// and each call's item events with one delta per character, completed.
func (b *responseBuilder) events() []event {
	g := b.g
	var evs []event
	seq := 0
	emit := func(typ string, tokens int, fields map[string]any) {
		fields["type"] = typ
		fields["sequence_number"] = seq
		seq++
		evs = append(evs, event{data: sseEvent(typ, fields), tokens: tokens})
	}
	emit("response.created", 0, map[string]any{"response": b.response("in_progress", false)})
	emit("response.in_progress", 0, map[string]any{"response": b.response("in_progress", false)})
	out := 0
	if b.hasMessage() {
		id := b.msgID()
		emit("response.output_item.added", 0, map[string]any{"output_index": out, "item": b.message("in_progress", "", nil)})
		emit("response.content_part.added", 0, map[string]any{"item_id": id, "output_index": out, "content_index": 0,
			"part": OutputContent{Type: "output_text", Annotations: []any{}, Logprobs: []LogprobEntry{}}})
		for _, p := range g.pieces {
			if p.kind == pieceContent {
				emit("response.output_text.delta", p.n, map[string]any{"item_id": id, "output_index": out, "content_index": 0,
					"delta": p.text, "logprobs": g.logprobEntries(p.from, p.n)})
			}
		}
		lps := b.contentLogprobs()
		emit("response.output_text.done", 0, map[string]any{"item_id": id, "output_index": out, "content_index": 0, "text": g.content, "logprobs": lps})
		part := OutputContent{Type: "output_text", Text: g.content, Annotations: []any{}, Logprobs: lps}
		emit("response.content_part.done", 0, map[string]any{"item_id": id, "output_index": out, "content_index": 0, "part": part})
		emit("response.output_item.done", 0, map[string]any{"output_index": out, "item": b.message("completed", g.content, lps)})
		out++
	}
	for i, c := range g.calls {
		id := b.fcID(i)
		for _, p := range g.pieces {
			if p.call != i {
				continue
			}
			switch p.kind {
			case pieceCallHead:
				emit("response.output_item.added", p.n, map[string]any{"output_index": out, "item": b.call(i, "in_progress", "")})
			case pieceCallArgs:
				emit("response.function_call_arguments.delta", p.n, map[string]any{"item_id": id, "output_index": out, "delta": p.text})
			case pieceCallTail:
				emit("response.function_call_arguments.done", p.n, map[string]any{"item_id": id, "output_index": out, "name": c.name, "arguments": c.args})
			}
		}
		emit("response.output_item.done", 0, map[string]any{"output_index": out, "item": b.call(i, "completed", c.args)})
		out++
	}
	emit("response.completed", 0, map[string]any{"response": b.response("completed", true)})
	return evs
}
