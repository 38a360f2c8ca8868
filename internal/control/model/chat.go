package model

import (
	"net/http"
)

// ChatCompletion is a non-streamed chat response, with vLLM's token-id
// extensions.
type ChatCompletion struct {
	ID                string       `json:"id"`
	Object            string       `json:"object"`
	Created           int64        `json:"created"`
	Model             string       `json:"model"`
	SystemFingerprint string       `json:"system_fingerprint"`
	Choices           []ChatChoice `json:"choices"`
	Usage             *Usage       `json:"usage"`
	PromptTokenIDs    []int64      `json:"prompt_token_ids"`
}

// ChatChoice is one choice of a ChatCompletion.
type ChatChoice struct {
	Index        int             `json:"index"`
	Message      ResponseMessage `json:"message"`
	Logprobs     *ChoiceLogprobs `json:"logprobs"`
	FinishReason string          `json:"finish_reason"`
	TokenIDs     []int64         `json:"token_ids"`
}

// ResponseMessage is the assistant message of a ChatChoice. Content is null
// when the message holds only tool calls.
type ResponseMessage struct {
	Role      string     `json:"role"`
	Content   *string    `json:"content"`
	Refusal   *string    `json:"refusal"`
	ToolCalls []ToolCall `json:"tool_calls,omitempty"`
}

// ChoiceLogprobs holds one entry per generated token.
type ChoiceLogprobs struct {
	Content []LogprobEntry `json:"content"`
}

// Usage counts tokens: PromptTokens = len(prompt_token_ids) and
// CompletionTokens = len(token_ids).
type Usage struct {
	PromptTokens     int `json:"prompt_tokens"`
	CompletionTokens int `json:"completion_tokens"`
	TotalTokens      int `json:"total_tokens"`
}

// ChatChunk is one streamed chat event. The first carries
// prompt_token_ids; each carries the token ids and logprobs of its delta; with
// stream_options.include_usage every chunk has "usage": null but a last one
// with no choices, which carries the usage.
type ChatChunk struct {
	ID                string        `json:"id"`
	Object            string        `json:"object"`
	Created           int64         `json:"created"`
	Model             string        `json:"model"`
	SystemFingerprint string        `json:"system_fingerprint"`
	Choices           []ChunkChoice `json:"choices"`
	Usage             *Usage        `json:"usage,omitempty"`
	PromptTokenIDs    []int64       `json:"prompt_token_ids,omitempty"`
}

// ChunkChoice is the choice of a ChatChunk.
type ChunkChoice struct {
	Index        int             `json:"index"`
	Delta        Delta           `json:"delta"`
	Logprobs     *ChoiceLogprobs `json:"logprobs"`
	FinishReason *string         `json:"finish_reason"`
	TokenIDs     []int64         `json:"token_ids,omitempty"`
}

// Delta is what a ChatChunk adds to the message.
type Delta struct {
	Role      string     `json:"role,omitempty"`
	Content   *string    `json:"content,omitempty"`
	ToolCalls []ToolCall `json:"tool_calls,omitempty"`
}

const fingerprint = "fp_stasis_scripted"

func (s *Server) serveChat(w http.ResponseWriter, r *http.Request) {
	body, req, ok := readRequest(s, w, r, ParseChatRequest)
	if !ok {
		return
	}
	s.answer(w, r, call{
		api: "chat", logMsg: "chat completion", body: body, conv: req.conversation(), model: req.Model, stream: req.Stream,
		events: func(g *generation, model string) []event {
			return chatEvents(g, model, s.created, req.StreamOptions != nil && req.StreamOptions.IncludeUsage)
		},
		whole: func(g *generation, model string) any { return chatCompletion(g, model, s.created) },
	})
}

func (g *generation) usage() *Usage {
	return &Usage{PromptTokens: len(g.promptIDs), CompletionTokens: len(g.ids), TotalTokens: len(g.promptIDs) + len(g.ids)}
}

func chatCompletion(g *generation, model string, created int64) *ChatCompletion {
	msg := ResponseMessage{Role: "assistant"}
	if g.content != "" || len(g.calls) == 0 {
		c := g.content
		msg.Content = &c
	}
	for _, c := range g.calls {
		msg.ToolCalls = append(msg.ToolCalls, ToolCall{ID: c.id, Type: "function", Function: FunctionCall{Name: c.name, Arguments: c.args}})
	}
	return &ChatCompletion{
		ID: "chatcmpl-" + g.id, Object: "chat.completion", Created: created, Model: model,
		SystemFingerprint: fingerprint,
		Choices: []ChatChoice{{
			Message: msg, Logprobs: &ChoiceLogprobs{Content: g.logprobEntries(0, len(g.ids))},
			FinishReason: g.finishReason(), TokenIDs: g.ids,
		}},
		Usage:          g.usage(),
		PromptTokenIDs: g.promptIDs,
	}
}

// chatEvents prepares a chat stream: a role chunk, one chunk per character
// of content or arguments (a tool call's name comes in the chunk that opens
// it), a finish chunk, the usage chunk when asked for, and [DONE].
func chatEvents(g *generation, model string, created int64, includeUsage bool) []event {
	base := func() ChatChunk {
		return ChatChunk{ID: "chatcmpl-" + g.id, Object: "chat.completion.chunk", Created: created, Model: model, SystemFingerprint: fingerprint}
	}
	type pending struct {
		chunk  ChatChunk
		tokens int
	}
	var chunks []pending
	empty := ""
	first := base()
	first.PromptTokenIDs = g.promptIDs
	first.Choices = []ChunkChoice{{Delta: Delta{Role: "assistant", Content: &empty}}}
	chunks = append(chunks, pending{chunk: first})
	for _, p := range g.pieces {
		ids := g.ids[p.from : p.from+p.n]
		lps := g.logprobEntries(p.from, p.n)
		if p.kind == pieceCallTail {
			// The call's closing tokens ride on its last chunk.
			last := &chunks[len(chunks)-1]
			ch := &last.chunk.Choices[0]
			ch.TokenIDs = append(ch.TokenIDs, ids...)
			ch.Logprobs.Content = append(ch.Logprobs.Content, lps...)
			last.tokens += p.n
			continue
		}
		c := base()
		var d Delta
		switch p.kind {
		case pieceContent:
			text := p.text
			d.Content = &text
		case pieceCallHead:
			i := p.call
			call := g.calls[i]
			d.ToolCalls = []ToolCall{{Index: &i, ID: call.id, Type: "function", Function: FunctionCall{Name: call.name, Arguments: ""}}}
		case pieceCallArgs:
			i := p.call
			d.ToolCalls = []ToolCall{{Index: &i, Function: FunctionCall{Arguments: p.text}}}
		}
		c.Choices = []ChunkChoice{{Delta: d, Logprobs: &ChoiceLogprobs{Content: lps}, TokenIDs: append([]int64(nil), ids...)}}
		chunks = append(chunks, pending{chunk: c, tokens: p.n})
	}
	fin := base()
	reason := g.finishReason()
	fin.Choices = []ChunkChoice{{Delta: Delta{}, FinishReason: &reason}}
	chunks = append(chunks, pending{chunk: fin})
	if includeUsage {
		u := base()
		u.Choices = []ChunkChoice{}
		u.Usage = g.usage()
		chunks = append(chunks, pending{chunk: u})
	}
	events := make([]event, 0, len(chunks)+1)
	for _, c := range chunks {
		var v any = c.chunk
		if includeUsage {
			// With include_usage every chunk says "usage", null but the last.
			v = struct {
				ChatChunk
				Usage *Usage `json:"usage"`
			}{c.chunk, c.chunk.Usage}
		}
		events = append(events, event{data: sseData(v), tokens: c.tokens})
	}
	return append(events, event{data: []byte("data: [DONE]\n\n")})
}
