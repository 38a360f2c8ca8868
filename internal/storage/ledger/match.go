package ledger

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"strings"
)

// Match is where a relaunched harness's conversation meets the ledger.
type Match struct {
	// Position is the logical length after the match, the seq of the last
	// matched entry: the ledger was cut to it, and the next entry is the
	// harness's next call.
	Position int64 `json:"position"`
	// Start is where the conversation's assistant messages begin in the
	// ledger (the seq of the first matched entry, less 1): 0 when they are
	// a prefix of it; more when the conversation was compacted and only
	// its last turns matched as one run.
	Start int64 `json:"start"`
	// Fresh: the ledger was empty and the conversation has no assistant
	// message: a first start, no boundary.
	Fresh bool `json:"fresh,omitempty"`
	// Boundary: the next appended entry is marked as the first after a
	// relaunch.
	Boundary bool `json:"boundary,omitempty"`
}

// Match matches the messages of a relaunched harness's first request (the
// chat-completions "messages" array) against the logical ledger. A
// harness's conversation never holds a response its client abandoned, so
// Abandoned entries are left out: the conversation's assistant messages, in
// order, must be the responses of the ledger's first k entries that are not
// Abandoned. Then the ledger is cut at the last of them (Position is its
// seq; Abandoned entries after it are cut too, those before it stay), the
// next entry is marked as a boundary, and Match returns. When they are not
// such a prefix but match exactly one contiguous run of the entries that
// are not Abandoned (a compacted conversation), the ledger is cut at the end
// of that run. No match, or a run found in more than one place, appends a
// broken record and returns an error wrapping ErrBroken: it is never taken
// for a new start.
//
// No assistant message at all is a fresh start when the ledger is empty (no
// record is written), and a start-over (cut to 0, boundary) otherwise.
func (l *Ledger) Match(messages []json.RawMessage) (Match, error) {
	var want []string
	var last json.RawMessage // the last assistant message that is not empty
	for i, m := range messages {
		var head struct {
			Role string `json:"role"`
		}
		if err := json.Unmarshal(m, &head); err != nil {
			return Match{}, fmt.Errorf("ledger match: message %d is not a JSON object: %v", i, err)
		}
		if head.Role == "assistant" {
			fp := messageFingerprint(m)
			want = append(want, fp)
			if fp != emptyAssistant {
				last = m
			}
		}
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	if err := l.usable(); err != nil {
		return Match{}, err
	}
	m, ok, reason, err := l.matchLocked(want, "")
	if err != nil || ok {
		return m, err
	}
	// A harness that records its turn before the model's answer is in it
	// (OpenCode) and was stopped in between sends that turn back empty:
	// the response it stands for was lost, not acted on. Without such
	// turns the conversation may match.
	if kept := withoutEmpty(want); len(kept) < len(want) {
		note := fmt.Sprintf(" (%d empty assistant messages, responses the harness lost, left out)", len(want)-len(kept))
		if m, ok, _, err := l.matchLocked(kept, note); err != nil || ok {
			return m, err
		}
		want = kept
	}
	// The same harness may have saved the last response it was given only
	// in part (a tool call without its arguments, the text missing): when
	// every earlier assistant message is the ledger's prefix, that last
	// turn is the response of the next entry, not acted on whole. The
	// ledger is cut before it, and the boundary marks where the harness's
	// history and the ledger part.
	have, seqs := l.visible()
	if k := len(want); k > 0 && k <= len(have) && equalRun(have[:k-1], want[:k-1]) && partialCopy(last, l.st.entries[seqs[k-1]-1].Response) {
		pos := int64(0)
		if k > 1 {
			pos = seqs[k-2]
		}
		if err := l.cut(pos, fmt.Sprintf("relaunch: the conversation's first %d assistant messages are entries 1..%d%s; its last is a partial copy of entry %d's response, not acted on whole", k-1, pos, l.abandonedNote(pos), seqs[k-1]), true); err != nil {
			return Match{}, err
		}
		return Match{Position: pos, Boundary: true}, nil
	}
	if err := l.markBroken(reason); err != nil {
		return Match{}, err
	}
	return Match{}, fmt.Errorf("ledger %s: %w: %s", l.where, ErrBroken, reason)
}

// partialCopy says whether assistant message msg is what a harness saved
// of response resp before all of it was in: it has tool calls, each with
// the id and the name of one of resp's, and its text is empty or the start
// of resp's.
func partialCopy(msg, resp json.RawMessage) bool {
	type call struct {
		ID       string `json:"id"`
		Function struct {
			Name string `json:"name"`
		} `json:"function"`
	}
	var m struct {
		Content   json.RawMessage `json:"content"`
		ToolCalls []call          `json:"tool_calls"`
	}
	var r struct {
		Choices []struct {
			Message struct {
				Content   json.RawMessage `json:"content"`
				ToolCalls []call          `json:"tool_calls"`
			} `json:"message"`
		} `json:"choices"`
	}
	if json.Unmarshal(msg, &m) != nil || json.Unmarshal(resp, &r) != nil || len(r.Choices) == 0 || len(m.ToolCalls) == 0 {
		return false
	}
	have := map[string]string{}
	for _, c := range r.Choices[0].Message.ToolCalls {
		have[c.ID] = c.Function.Name
	}
	for _, c := range m.ToolCalls {
		if name, ok := have[c.ID]; c.ID == "" || !ok || name != c.Function.Name {
			return false
		}
	}
	text := func(raw json.RawMessage) string {
		var s string
		_ = json.Unmarshal(raw, &s)
		return strings.TrimSpace(s)
	}
	got := text(m.Content)
	return got == "" || strings.HasPrefix(text(r.Choices[0].Message.Content), got)
}

// emptyAssistant is the fingerprint of an assistant message with no text
// and no tool call.
var emptyAssistant = assistant{}.fingerprint()

func withoutEmpty(fps []string) []string {
	var out []string
	for _, fp := range fps {
		if fp != emptyAssistant {
			out = append(out, fp)
		}
	}
	return out
}

// visible returns the fingerprints of the live entries that are not
// Abandoned — the responses a harness can have in its conversation — and
// their seqs. l.mu is held.
func (l *Ledger) visible() (fps []string, seqs []int64) {
	all := l.fingerprints()
	fps = make([]string, 0, len(all))
	seqs = make([]int64, 0, len(all))
	for i, e := range l.st.entries {
		if e.Disposition != Abandoned {
			fps = append(fps, all[i])
			seqs = append(seqs, e.Seq)
		}
	}
	return fps, seqs
}

// abandonedNote says how many of the first pos live entries are Abandoned,
// for a cut's reason ("" when none is). l.mu is held.
func (l *Ledger) abandonedNote(pos int64) string {
	n := 0
	for _, e := range l.st.entries[:pos] {
		if e.Disposition == Abandoned {
			n++
		}
	}
	if n == 0 {
		return ""
	}
	return fmt.Sprintf(" (the %d abandoned among them left out)", n)
}

// matchLocked matches the conversation's assistant fingerprints against
// the live entries that are not Abandoned: on a match it cuts the ledger
// (the cut's reason ends with note) and returns ok; otherwise it changes
// nothing and returns why not.
func (l *Ledger) matchLocked(want []string, note string) (Match, bool, string, error) {
	have, seqs := l.visible()
	k := len(want)
	if k == 0 && len(l.st.entries) == 0 {
		return Match{Fresh: true}, true, "", nil
	}
	if k <= len(have) && equalRun(have[:k], want) {
		pos := int64(0)
		if k > 0 {
			pos = seqs[k-1]
		}
		if err := l.cut(pos, fmt.Sprintf("relaunch: the conversation's %d assistant messages are entries 1..%d%s%s", k, pos, l.abandonedNote(pos), note), true); err != nil {
			return Match{}, false, "", err
		}
		return Match{Position: pos, Boundary: true}, true, "", nil
	}
	var at []int
	for p := 1; k > 0 && p+k <= len(have); p++ {
		if equalRun(have[p:p+k], want) {
			at = append(at, p)
		}
	}
	// Entries the harness could not have seen, for the reasons below.
	abandoned := ""
	if n := len(l.st.entries) - len(have); n > 0 {
		abandoned = fmt.Sprintf(" not abandoned (%d more were)", n)
	}
	switch {
	case len(at) == 1:
		from, pos := seqs[at[0]], seqs[at[0]+k-1]
		if err := l.cut(pos, fmt.Sprintf("relaunch: the conversation's %d assistant messages are entries %d..%d (compacted)%s%s", k, from, pos, l.abandonedNote(pos), note), true); err != nil {
			return Match{}, false, "", err
		}
		return Match{Position: pos, Start: from - 1, Boundary: true}, true, "", nil
	case len(at) > 1:
		return Match{}, false, fmt.Sprintf("relaunch: the conversation's %d assistant messages match the ledger at %d places (entries %d.. and %d..); cannot tell which responses the harness acted on", k, len(at), seqs[at[0]], seqs[at[1]]), nil
	case k > len(have):
		return Match{}, false, fmt.Sprintf("relaunch: the conversation has %d assistant messages but the ledger only %d entries%s: the harness acted on responses the ledger does not hold", k, len(have), abandoned), nil
	default:
		i := 0
		for i < len(want) && want[i] == have[i] {
			i++
		}
		return Match{}, false, fmt.Sprintf("relaunch: the conversation's assistant message %d differs from entry %d's response, and its %d assistant messages match no run of the ledger's %d entries%s", i+1, seqs[i], k, len(have), abandoned), nil
	}
}

func equalRun(a, b []string) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

// assistant is an assistant message reduced to what its fingerprint covers.
type assistant struct {
	Content string     `json:"content"`
	Calls   []toolCall `json:"tool_calls"`
}

type toolCall struct {
	Name      string          `json:"name"`
	Arguments json.RawMessage `json:"arguments"`
}

// fingerprint hashes the role, the content text and each tool call's name
// and arguments. Arguments that are JSON (as a string, the chat-completions
// way, or inline) are canonicalised — keys sorted, whitespace dropped — so
// key order and spacing do not matter; content text is compared with its
// surrounding whitespace trimmed.
func (a assistant) fingerprint() string {
	var b bytes.Buffer
	b.WriteString("assistant\x00")
	b.WriteString(strings.TrimSpace(a.Content))
	for _, c := range a.Calls {
		b.WriteString("\x00call\x00")
		b.WriteString(c.Name)
		b.WriteByte(0)
		b.Write(canonArgs(c.Arguments))
	}
	sum := sha256.Sum256(b.Bytes())
	return hex.EncodeToString(sum[:])
}

// canonArgs returns tool-call arguments in canonical JSON: a JSON string
// holding JSON is unwrapped; anything that is not JSON is kept as text.
func canonArgs(raw json.RawMessage) []byte {
	raw = bytes.TrimSpace(raw)
	if len(raw) == 0 || string(raw) == "null" {
		return []byte("{}")
	}
	var s string
	if raw[0] == '"' && json.Unmarshal(raw, &s) == nil {
		if strings.TrimSpace(s) == "" {
			return []byte("{}")
		}
		raw = json.RawMessage(s)
	}
	if c, ok := canonValue(raw); ok {
		return c
	}
	return raw
}

// canonValue re-encodes JSON with sorted keys and no whitespace.
func canonValue(raw []byte) ([]byte, bool) {
	d := json.NewDecoder(bytes.NewReader(raw))
	d.UseNumber()
	var v any
	if err := d.Decode(&v); err != nil || d.More() {
		return nil, false
	}
	b, err := json.Marshal(v) // maps marshal with sorted keys
	if err != nil {
		return nil, false
	}
	return b, true
}

// contentText is the text of a message's content: a string, or the text of
// an array of parts ({"type":"text","text":...}, responses-API
// "output_text" and "input_text" parts), joined.
func contentText(raw json.RawMessage) string {
	raw = bytes.TrimSpace(raw)
	if len(raw) == 0 || string(raw) == "null" {
		return ""
	}
	var s string
	if json.Unmarshal(raw, &s) == nil {
		return s
	}
	var parts []struct {
		Type    string `json:"type"`
		Text    string `json:"text"`
		Refusal string `json:"refusal"`
	}
	if json.Unmarshal(raw, &parts) != nil {
		return string(raw)
	}
	var b strings.Builder
	for _, p := range parts {
		switch p.Type {
		case "", "text", "output_text", "input_text":
			b.WriteString(p.Text)
		case "refusal":
			b.WriteString(p.Refusal)
		}
	}
	return b.String()
}

// chatMessage is an assistant message in chat-completions form.
type chatMessage struct {
	Role      string          `json:"role"`
	Content   json.RawMessage `json:"content"`
	ToolCalls []struct {
		Type     string `json:"type"`
		Function struct {
			Name      string          `json:"name"`
			Arguments json.RawMessage `json:"arguments"`
		} `json:"function"`
	} `json:"tool_calls"`
	// FunctionCall is the legacy single function call.
	FunctionCall *struct {
		Name      string          `json:"name"`
		Arguments json.RawMessage `json:"arguments"`
	} `json:"function_call"`
}

func (m chatMessage) assistant() assistant {
	a := assistant{Content: contentText(m.Content)}
	for _, c := range m.ToolCalls {
		a.Calls = append(a.Calls, toolCall{Name: c.Function.Name, Arguments: c.Function.Arguments})
	}
	if m.FunctionCall != nil {
		a.Calls = append(a.Calls, toolCall{Name: m.FunctionCall.Name, Arguments: m.FunctionCall.Arguments})
	}
	return a
}

// messageFingerprint fingerprints an assistant message of a request.
func messageFingerprint(raw json.RawMessage) string {
	var m chatMessage
	if err := json.Unmarshal(raw, &m); err != nil {
		sum := sha256.Sum256(raw)
		return "unparsable message:" + hex.EncodeToString(sum[:])
	}
	return m.assistant().fingerprint()
}

// responseFingerprint fingerprints the assistant message a response holds:
// choices[0].message of a chat completion, or the message and function-call
// output items of a responses-API object.
func responseFingerprint(raw json.RawMessage) string {
	if json.Valid(raw) {
		if s := scanResponse(raw); s.fpOK {
			return s.fp
		}
	}
	return responseFingerprintJSON(raw)
}

// responseFingerprintJSON is responseFingerprint by encoding/json: what
// scanResponse must agree with, and what it falls back to.
func responseFingerprintJSON(raw json.RawMessage) string {
	var r struct {
		Choices []struct {
			Message *chatMessage `json:"message"`
		} `json:"choices"`
		Output []struct {
			Type      string          `json:"type"`
			Role      string          `json:"role"`
			Content   json.RawMessage `json:"content"`
			Name      string          `json:"name"`
			Arguments json.RawMessage `json:"arguments"`
		} `json:"output"`
	}
	if err := json.Unmarshal(raw, &r); err != nil {
		sum := sha256.Sum256(raw)
		return "unparsable:" + hex.EncodeToString(sum[:])
	}
	if len(r.Choices) > 0 && r.Choices[0].Message != nil {
		return r.Choices[0].Message.assistant().fingerprint()
	}
	var a assistant
	var text strings.Builder
	for _, it := range r.Output {
		switch it.Type {
		case "message":
			text.WriteString(contentText(it.Content))
		case "function_call":
			a.Calls = append(a.Calls, toolCall{Name: it.Name, Arguments: it.Arguments})
		}
	}
	a.Content = text.String()
	return a.fingerprint()
}
