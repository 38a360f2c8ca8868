package model

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"strings"
)

// A Script is the conversation the scripted model plays: turn k is the
// answer to a request that already holds k assistant messages.
//
// In JSON a script is either a list of turns or an object with "turns" (and
// an optional "name", for messages):
//
//	{"name": "fix-readme", "turns": [
//	  {"tool_calls": [{"name": "read_file", "arguments": {"path": "README.md"},
//	                   "alternatives": [{"name": "read", "arguments": {"filePath": "README.md"}}]}]},
//	  {"content": "Fixing the typo.",
//	   "tool_calls": [{"name": "write_file", "arguments": {"path": "README.md", "content": "hello\n"}}]},
//	  {"tool_calls": [{"name": "run", "arguments": {"command": "make test"},
//	                   "alternatives": [{"name": "bash", "arguments": {"command": "make test", "description": "Run the tests"}}]}]},
//	  {"content": "The typo is fixed and the tests pass."}
//	]}
type Script struct {
	Name string `json:"name,omitempty"`
	// Match, when set, selects this script for a conversation one of
	// whose user messages contains it (a task's problem statement, say);
	// see Options.Scripts.
	Match string `json:"match,omitempty"`
	Turns []Turn `json:"turns"`
}

// A Turn is one assistant message: tool calls (with optional text beside
// them) or a final text answer.
type Turn struct {
	Content   string       `json:"content,omitempty"`
	ToolCalls []ScriptCall `json:"tool_calls,omitempty"`
}

// A ScriptCall is one tool call. The server uses the first of Name and the
// Alternatives' names that the request offers as a tool, so one script can
// drive harnesses whose tools are named differently (the mini harness's
// read_file and run, OpenCode's read and bash).
type ScriptCall struct {
	Name string `json:"name"`
	// Arguments is a JSON object; in a script file it may also be written
	// as a string holding a JSON object.
	Arguments    json.RawMessage `json:"arguments,omitempty"`
	Alternatives []ToolAlt       `json:"alternatives,omitempty"`
}

// A ToolAlt is another name, with its own arguments, for the same call.
type ToolAlt struct {
	Name      string          `json:"name"`
	Arguments json.RawMessage `json:"arguments,omitempty"`
}

// DefaultScript reads a file, runs a command, and answers. Its calls name the
// mini harness's tools (read_file, run) with OpenCode's (read, bash) as
// alternatives.
func DefaultScript() *Script {
	return &Script{
		Name: "default",
		Turns: []Turn{
			{ToolCalls: []ScriptCall{{
				Name: "read_file", Arguments: json.RawMessage(`{"path":"README.md"}`),
				Alternatives: []ToolAlt{{Name: "read", Arguments: json.RawMessage(`{"filePath":"README.md"}`)}},
			}}},
			{ToolCalls: []ScriptCall{{
				Name: "run", Arguments: json.RawMessage(`{"command":"ls"}`),
				Alternatives: []ToolAlt{{Name: "bash", Arguments: json.RawMessage(`{"command":"ls","description":"List the files in the work tree"}`)}},
			}}},
			{Content: "I read README.md and listed the work tree. Done."},
		},
	}
}

// LoadScript reads and validates a JSON script file.
func LoadScript(path string) (*Script, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("script: %w", err)
	}
	s, err := ParseScript(b)
	if err != nil {
		return nil, fmt.Errorf("script %s: %w", path, err)
	}
	return s, nil
}

// ParseScript decodes and validates a JSON script: a list of turns, or an
// object with "turns". Arguments are normalised to compact JSON objects.
func ParseScript(b []byte) (*Script, error) {
	var s Script
	trimmed := bytes.TrimSpace(b)
	if len(trimmed) > 0 && trimmed[0] == '[' {
		if err := strictDecode(trimmed, &s.Turns); err != nil {
			return nil, fmt.Errorf("not a JSON list of turns: %w", err)
		}
	} else if err := strictDecode(trimmed, &s); err != nil {
		return nil, fmt.Errorf(`not a JSON script (a list of turns, or {"turns": [...]}): %w`, err)
	}
	if err := s.normalise(); err != nil {
		return nil, err
	}
	return &s, nil
}

func strictDecode(b []byte, v any) error {
	d := json.NewDecoder(bytes.NewReader(b))
	d.DisallowUnknownFields()
	if err := d.Decode(v); err != nil {
		return err
	}
	if d.More() {
		return errors.New("trailing data after the script")
	}
	return nil
}

// normalise validates s and compacts every call's arguments.
func (s *Script) normalise() error {
	if len(s.Turns) == 0 {
		return errors.New("the script has no turns")
	}
	for i := range s.Turns {
		t := &s.Turns[i]
		if t.Content == "" && len(t.ToolCalls) == 0 {
			return fmt.Errorf("turn %d: give \"content\" (a text answer) or \"tool_calls\"", i)
		}
		for j := range t.ToolCalls {
			c := &t.ToolCalls[j]
			var err error
			if c.Arguments, err = normaliseArgs(c.Name, c.Arguments); err != nil {
				return fmt.Errorf("turn %d, tool call %d: %w", i, j, err)
			}
			for k := range c.Alternatives {
				a := &c.Alternatives[k]
				if a.Arguments, err = normaliseArgs(a.Name, a.Arguments); err != nil {
					return fmt.Errorf("turn %d, tool call %d, alternative %d: %w", i, j, k, err)
				}
			}
		}
	}
	return nil
}

func normaliseArgs(name string, raw json.RawMessage) (json.RawMessage, error) {
	if strings.TrimSpace(name) == "" {
		return nil, errors.New(`"name" is empty: name the tool to call`)
	}
	raw = bytes.TrimSpace(raw)
	if len(raw) == 0 || bytes.Equal(raw, []byte("null")) {
		return json.RawMessage(`{}`), nil
	}
	if raw[0] == '"' {
		var s string
		if err := json.Unmarshal(raw, &s); err != nil {
			return nil, fmt.Errorf("%s: arguments: %w", name, err)
		}
		raw = []byte(s)
	}
	var obj map[string]any
	if err := json.Unmarshal(raw, &obj); err != nil || obj == nil {
		return nil, fmt.Errorf("%s: arguments must be a JSON object, got %.40q", name, raw)
	}
	var buf bytes.Buffer
	if err := json.Compact(&buf, raw); err != nil {
		return nil, fmt.Errorf("%s: arguments: %w", name, err)
	}
	return buf.Bytes(), nil
}
