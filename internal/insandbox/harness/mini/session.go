package mini

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"stasis/internal/storage/atomicfile"
)

// SessionFormat is the "format" field of a session file.
const SessionFormat = "stasis-mini-session"

// SessionVersion is the version of the session file format this package
// reads and writes.
const SessionVersion = 1

// A session file is a JSON object:
//
//	{
//	  "format": "stasis-mini-session",
//	  "version": 1,
//	  "model": "stasis-scripted",
//	  "workdir": "/work",
//	  "steps": 2,
//	  "done": false,
//	  "answer": "",
//	  "messages": [
//	    {"role":"system","content":"..."},
//	    {"role":"user","content":"fix the failing test"},
//	    {"role":"assistant","content":null,"tool_calls":[...]},
//	    {"role":"tool","tool_call_id":"call_1","content":"exit code: 1\n..."}
//	  ]
//	}
//
// Each element of messages is kept byte for byte as it was sent (assistant
// messages as the server returned them), so that a resumed agent sends
// exactly the history it sent before. steps, done and answer are derived
// from messages (written for people and tools that read the file; on load
// they are recomputed).
type sessionFile struct {
	Format   string            `json:"format"`
	Version  int               `json:"version"`
	Model    string            `json:"model"`
	WorkDir  string            `json:"workdir"`
	Steps    int               `json:"steps"`
	Done     bool              `json:"done"`
	Answer   string            `json:"answer"`
	Messages []json.RawMessage `json:"messages,omitempty"`
}

// session is the conversation in memory.
type session struct {
	path     string
	model    string
	workdir  string
	messages []json.RawMessage
}

// message is the part of a chat message mini reads.
type message struct {
	Role       string          `json:"role"`
	Content    json.RawMessage `json:"content"`
	ToolCalls  []toolCall      `json:"tool_calls"`
	ToolCallID string          `json:"tool_call_id"`
}

type toolCall struct {
	ID       string `json:"id"`
	Type     string `json:"type"`
	Function struct {
		Name      string          `json:"name"`
		Arguments json.RawMessage `json:"arguments"`
	} `json:"function"`
}

// save writes the session atomically and durably.
func (s *session) save() error {
	st := s.state()
	head, err := json.MarshalIndent(sessionFile{
		Format: SessionFormat, Version: SessionVersion, Model: s.model, WorkDir: s.workdir,
		Steps: st.steps, Done: st.done, Answer: st.answer,
	}, "", "  ")
	if err != nil {
		return fmt.Errorf("mini: session %s: %w", s.path, err)
	}
	// json.Marshal would re-encode the messages (compacting them and
	// escaping HTML characters); write them verbatim instead.
	var b bytes.Buffer
	b.Write(bytes.TrimSuffix(head, []byte("\n}")))
	b.WriteString(",\n  \"messages\": [")
	for i, m := range s.messages {
		if i > 0 {
			b.WriteByte(',')
		}
		b.WriteString("\n    ")
		b.Write(m)
	}
	b.WriteString("\n  ]\n}\n")
	if err := os.MkdirAll(filepath.Dir(s.path), 0o755); err != nil {
		return fmt.Errorf("mini: session %s: %w", s.path, err)
	}
	if err := atomicfile.Write(s.path, b.Bytes(), 0o600); err != nil {
		return fmt.Errorf("mini: saving the session: %w", err)
	}
	return nil
}

// loadSession reads a session file. A file that does not exist gives an
// error satisfying errors.Is(err, fs.ErrNotExist); anything unreadable,
// malformed or of another version is an error naming the file.
func loadSession(path string) (*session, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("mini: session: %w", err)
	}
	bad := func(format string, a ...any) error {
		return fmt.Errorf("mini: session file %s: %s; it is left as it is: fix it, or remove it to start over", path, fmt.Sprintf(format, a...))
	}
	var probe struct {
		Format  *string `json:"format"`
		Version *int    `json:"version"`
	}
	if err := json.Unmarshal(b, &probe); err != nil {
		return nil, bad("not a mini session (not a JSON object: %v)", err)
	}
	if probe.Format == nil || *probe.Format != SessionFormat {
		return nil, bad("not a mini session (\"format\" is not %q)", SessionFormat)
	}
	if probe.Version == nil || *probe.Version != SessionVersion {
		v := "missing"
		if probe.Version != nil {
			v = fmt.Sprint(*probe.Version)
		}
		return nil, bad("version %s, and this mini reads version %d only", v, SessionVersion)
	}
	var f sessionFile
	if err := json.Unmarshal(b, &f); err != nil {
		return nil, bad("%v", err)
	}
	if len(f.Messages) == 0 {
		return nil, bad("it holds no messages")
	}
	s := &session{path: path, model: f.Model, workdir: f.WorkDir, messages: f.Messages}
	if err := s.check(); err != nil {
		return nil, bad("%v", err)
	}
	return s, nil
}

// check validates the conversation: every message is an object with a known
// role, and what follows the last assistant message is only its tool
// results, no more than it has calls.
func (s *session) check() error {
	last := -1
	for i, raw := range s.messages {
		m, err := parseMessage(raw)
		if err != nil {
			return fmt.Errorf("messages[%d]: %v", i, err)
		}
		switch m.Role {
		case "system", "user", "tool":
		case "assistant":
			last = i
		default:
			return fmt.Errorf("messages[%d]: unknown role %q", i, m.Role)
		}
	}
	if last < 0 {
		return nil
	}
	calls, _ := parseMessage(s.messages[last])
	after := s.messages[last+1:]
	for i, raw := range after {
		m, _ := parseMessage(raw)
		if m.Role != "tool" {
			return fmt.Errorf("messages[%d]: a %s message after the last assistant message; only tool results can follow it", last+1+i, m.Role)
		}
	}
	if len(after) > len(calls.ToolCalls) {
		return fmt.Errorf("the last assistant message has %d tool calls but %d results follow it", len(calls.ToolCalls), len(after))
	}
	return nil
}

func parseMessage(raw json.RawMessage) (message, error) {
	var m message
	if err := json.Unmarshal(raw, &m); err != nil {
		return m, fmt.Errorf("not a chat message: %v", err)
	}
	if m.Role == "" {
		return m, errors.New(`"role" is missing`)
	}
	return m, nil
}

// sessionState is what the conversation says about itself.
type sessionState struct {
	steps   int        // assistant messages
	done    bool       // the last message is an assistant message without tool calls
	answer  string     // its text
	pending []toolCall // calls of the last assistant message still without a result
	step    int        // the step of the pending calls (the last assistant message's)
}

func (s *session) state() sessionState {
	var st sessionState
	last := -1
	var lastMsg message
	for i, raw := range s.messages {
		m, err := parseMessage(raw)
		if err != nil || m.Role != "assistant" {
			continue
		}
		st.steps++
		last, lastMsg = i, m
	}
	if last < 0 {
		return st
	}
	st.step = st.steps
	if len(lastMsg.ToolCalls) == 0 {
		st.done, st.answer = last == len(s.messages)-1, contentText(lastMsg.Content)
		return st
	}
	// Results are appended in the order of the calls.
	if results := len(s.messages) - 1 - last; results < len(lastMsg.ToolCalls) {
		st.pending = lastMsg.ToolCalls[results:]
	}
	return st
}

// contentText is a message's text: a string, or the text parts of a list.
func contentText(raw json.RawMessage) string {
	raw = bytes.TrimSpace(raw)
	if len(raw) == 0 {
		return ""
	}
	var s string
	if json.Unmarshal(raw, &s) == nil {
		return s
	}
	var parts []struct {
		Type string `json:"type"`
		Text string `json:"text"`
	}
	if json.Unmarshal(raw, &parts) == nil {
		var b strings.Builder
		for _, p := range parts {
			b.WriteString(p.Text)
		}
		return b.String()
	}
	return ""
}

// jsonMessage encodes a message mini writes itself (system, user, tool).
func jsonMessage(v any) json.RawMessage {
	b, err := json.Marshal(v)
	if err != nil {
		panic("mini: encoding a message: " + err.Error()) // strings only: cannot fail
	}
	return b
}
