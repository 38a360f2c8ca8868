package model

import (
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"math"
	"math/rand/v2"
	"strconv"
	"strings"
	"unicode/utf8"
)

// genCall is one tool call, in a request's history or generated.
type genCall struct {
	id   string
	name string
	args string
}

// pieceKind tells what part of a completion a piece is.
type pieceKind int

const (
	pieceContent  pieceKind = iota // text, one character
	pieceCallHead                  // <tool_call>{"name":"N","arguments":
	pieceCallArgs                  // arguments text, one character
	pieceCallTail                  // }</tool_call>
)

// A piece is the smallest unit a stream sends: one character of text or
// arguments (never half of a UTF-8 sequence), or a tool call's frame.
type piece struct {
	kind pieceKind
	call int    // index into generation.calls for call pieces
	text string // the text the piece adds to content or arguments
	from int    // index of its first token in generation.ids
	n    int    // number of tokens
}

// generation is one response of the scripted model, whatever the API.
type generation struct {
	key       [32]byte // hash of seed, endpoint and request body
	id        string   // hex, derived from key; APIs add their prefix
	turn      int      // index of the script turn played (len(turns) past the end)
	content   string
	calls     []genCall
	promptIDs []int64
	ids       []int64
	logprobs  []float64
	top       [][]topEntry // per token, when top logprobs were asked for
	pieces    []piece
}

type topEntry struct {
	id      int64
	logprob float64
}

// finishReason is the chat finish_reason.
func (g *generation) finishReason() string {
	if len(g.calls) > 0 {
		return "tool_calls"
	}
	return "stop"
}

// requestKey hashes the seed, the endpoint and the request body: everything a
// response depends on.
func requestKey(seed int64, endpoint string, body []byte) [32]byte {
	h := sha256.New()
	var b [8]byte
	binary.LittleEndian.PutUint64(b[:], uint64(seed))
	h.Write(b[:])
	h.Write([]byte(endpoint))
	h.Write([]byte{0})
	h.Write(body)
	var k [32]byte
	copy(k[:], h.Sum(nil))
	return k
}

// subID is a hex id derived from the request key and a label.
func subID(key [32]byte, label string, n int) string {
	h := sha256.New()
	h.Write(key[:])
	h.Write([]byte(label))
	h.Write([]byte(strconv.Itoa(n)))
	return hex.EncodeToString(h.Sum(nil))[:24]
}

// pickTurn chooses the script turn for a conversation and resolves its tool
// names against the tools the request offers.
func (s *Server) pickTurn(c *conversation) (int, string, []genCall) {
	turns := s.scriptFor(c).Turns
	idx := c.assistant
	if idx >= len(turns) {
		last := turns[len(turns)-1]
		if len(last.ToolCalls) == 0 {
			return idx, last.Content, nil
		}
		return idx, fmt.Sprintf("The script has %d turns and all of them are done.", len(turns)), nil
	}
	t := turns[idx]
	if len(t.ToolCalls) == 0 {
		return idx, t.Content, nil
	}
	offered := make(map[string]bool, len(c.tools))
	for _, n := range c.tools {
		offered[n] = true
	}
	var calls []genCall
	for _, sc := range t.ToolCalls {
		names := []string{sc.Name}
		args := []json.RawMessage{sc.Arguments}
		for _, a := range sc.Alternatives {
			names = append(names, a.Name)
			args = append(args, a.Arguments)
		}
		found := -1
		for i, n := range names {
			if offered[n] {
				found = i
				break
			}
		}
		if found < 0 {
			want := strings.Join(names, " or ")
			if len(c.tools) == 0 {
				return idx, fmt.Sprintf("The script calls the tool %s at turn %d, but the request offers no tools.", want, idx), nil
			}
			return idx, fmt.Sprintf("The script calls the tool %s at turn %d, but the request's tools are: %s.", want, idx, strings.Join(c.tools, ", ")), nil
		}
		calls = append(calls, genCall{name: names[found], args: string(args[found])})
	}
	return idx, t.Content, calls
}

// scriptFor is the script a conversation plays: the first of the Scripts
// whose Match one of its user messages contains, else the Script.
func (s *Server) scriptFor(c *conversation) *Script {
	if len(s.scripts) == 0 {
		return s.script
	}
	for _, m := range c.messages {
		if m.role != "user" {
			continue
		}
		// Backslashes are ignored on both sides: a harness may escape
		// quotes in the prompt it was given (OpenCode quotes a message
		// holding spaces and escapes the quotes inside).
		text := strings.ReplaceAll(m.content, `\`, "")
		for _, sc := range s.scripts {
			if sc.Match != "" && len(sc.Turns) > 0 && strings.Contains(text, strings.ReplaceAll(sc.Match, `\`, "")) {
				return sc
			}
		}
	}
	return s.script
}

// generate plays the script for one request.
func (s *Server) generate(c *conversation, key [32]byte) *generation {
	g := &generation{key: key, id: hex.EncodeToString(key[:12])}
	g.turn, g.content, g.calls = s.pickTurn(c)
	for i := range g.calls {
		g.calls[i].id = "call_" + subID(key, "call", i)
	}
	g.promptIDs = promptIDs(c)

	add := func(kind pieceKind, call int, text string, ids []int64) {
		g.pieces = append(g.pieces, piece{kind: kind, call: call, text: text, from: len(g.ids), n: len(ids)})
		g.ids = append(g.ids, ids...)
	}
	addText := func(kind pieceKind, call int, text string) {
		for len(text) > 0 {
			_, size := utf8.DecodeRuneInString(text)
			add(kind, call, text[:size], Tokenize(text[:size]))
			text = text[size:]
		}
	}
	addText(pieceContent, -1, g.content)
	for i, call := range g.calls {
		add(pieceCallHead, i, "", append([]int64{TokenToolCall}, Tokenize(callHead(call.name))...))
		addText(pieceCallArgs, i, call.args)
		add(pieceCallTail, i, "", append(Tokenize("}"), TokenToolCallEnd))
	}

	rng := rand.New(rand.NewPCG(binary.LittleEndian.Uint64(key[0:8]), binary.LittleEndian.Uint64(key[8:16])))
	g.logprobs = make([]float64, len(g.ids))
	if c.topLogprobs > 0 {
		g.top = make([][]topEntry, len(g.ids))
	}
	for i, id := range g.ids {
		lp := roundLogprob(-(0.0001 + 2.5*math.Pow(rng.Float64(), 3)))
		g.logprobs[i] = lp
		if g.top == nil {
			continue
		}
		top := []topEntry{{id, lp}}
		seen := map[int64]bool{id: true}
		for len(top) < c.topLogprobs {
			alt := ByteOffset + rng.Int64N(256)
			if seen[alt] {
				continue
			}
			seen[alt] = true
			prev := top[len(top)-1].logprob
			top = append(top, topEntry{alt, roundLogprob(prev - 0.5 - 3*rng.Float64())})
		}
		g.top[i] = top
	}
	return g
}

func roundLogprob(x float64) float64 { return math.Round(x*1e6) / 1e6 }

// callHead is the text between <tool_call> and a call's arguments.
func callHead(name string) string {
	n, _ := json.Marshal(name)
	return `{"name":` + string(n) + `,"arguments":`
}

// callIDs are the tokens of one tool call, as generated and as found again
// in a later prompt.
func callIDs(c genCall) []int64 {
	ids := []int64{TokenToolCall}
	ids = append(ids, Tokenize(callHead(c.name)+c.args+"}")...)
	return append(ids, TokenToolCallEnd)
}

// promptIDs flattens a conversation into prompt tokens:
//
//	<|bos|>[<|im_start|>tools\nTOOL...<|im_end|>\n]
//	(<|im_start|>ROLE\nCONTENT[<tool_call>...</tool_call>...]<|im_end|>\n)*
//	<|im_start|>assistant\n
//
// An assistant message's content and tool calls give the very tokens the
// model generated for them, so each prompt extends the previous turn's.
func promptIDs(c *conversation) []int64 {
	ids := []int64{TokenBOS}
	if len(c.toolsJSON) > 0 {
		ids = append(ids, TokenIMStart)
		ids = append(ids, Tokenize("tools\n"+strings.Join(c.toolsJSON, "\n"))...)
		ids = append(ids, TokenIMEnd)
		ids = append(ids, Tokenize("\n")...)
	}
	for _, m := range c.messages {
		ids = append(ids, TokenIMStart)
		ids = append(ids, Tokenize(m.role+"\n"+m.content)...)
		for _, call := range m.calls {
			ids = append(ids, callIDs(call)...)
		}
		ids = append(ids, TokenIMEnd)
		ids = append(ids, Tokenize("\n")...)
	}
	ids = append(ids, TokenIMStart)
	return append(ids, Tokenize("assistant\n")...)
}

// LogprobEntry is one entry of choices[].logprobs.content in a chat
// response (and of output_text logprobs in a responses one).
type LogprobEntry struct {
	Token       string       `json:"token"`
	Logprob     float64      `json:"logprob"`
	Bytes       []int        `json:"bytes"`
	TopLogprobs []TopLogprob `json:"top_logprobs"`
}

// TopLogprob is one alternative of a LogprobEntry.
type TopLogprob struct {
	Token   string  `json:"token"`
	Logprob float64 `json:"logprob"`
	Bytes   []int   `json:"bytes"`
}

func tokenByteInts(id int64) []int {
	b, _ := tokenBytes(id)
	out := make([]int, len(b))
	for i, x := range b {
		out[i] = int(x)
	}
	return out
}

// logprobEntries are the entries of tokens [from, from+n).
func (g *generation) logprobEntries(from, n int) []LogprobEntry {
	out := make([]LogprobEntry, n)
	for i := range n {
		id := g.ids[from+i]
		e := LogprobEntry{Token: tokenString(id), Logprob: g.logprobs[from+i], Bytes: tokenByteInts(id), TopLogprobs: []TopLogprob{}}
		if g.top != nil {
			for _, t := range g.top[from+i] {
				e.TopLogprobs = append(e.TopLogprobs, TopLogprob{Token: tokenString(t.id), Logprob: t.logprob, Bytes: tokenByteInts(t.id)})
			}
		}
		out[i] = e
	}
	return out
}
