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
	a := chatAssembly{role: "assistant", calls: map[int]obj{}, args: map[int]*strings.Builder{}, extras: obj{}}
	for _, ev := range events {
		if err := a.add(ev); err != nil {
			return nil, err
		}
	}
	return a.completion()
}

// chatAssembly is a chat.completion being assembled from its chunks.
type chatAssembly struct {
	top      obj // the first chunk's members but choices and usage
	content  strings.Builder
	role     string
	finish   json.RawMessage
	usage    json.RawMessage
	calls    map[int]obj              // tool calls by index: id, type, name
	args     map[int]*strings.Builder // and their arguments
	extras   obj                      // the choices' other members
	anyDelta bool
}

// add merges one chunk.
func (a *chatAssembly) add(ev Event) error {
	c, err := decodeObj(ev.Data)
	if err != nil {
		return fmt.Errorf("stream chunk: %w", err)
	}
	if a.top == nil {
		a.top = obj{}
		for k, v := range c {
			if k != "choices" && k != "usage" {
				a.top[k] = v
			}
		}
	}
	if u, ok := c["usage"]; ok && string(u) != "null" {
		a.usage = u
	}
	var choices []obj
	_ = json.Unmarshal(c["choices"], &choices)
	for _, ch := range choices {
		a.addChoice(ch)
	}
	return nil
}

// addChoice merges a chunk's choice.
func (a *chatAssembly) addChoice(ch obj) {
	for k, v := range ch {
		if k != "delta" && k != "index" && k != "finish_reason" {
			a.extras[k] = v
		}
	}
	if f, ok := ch["finish_reason"]; ok && string(f) != "null" {
		a.finish = f
	}
	delta, err := decodeObj(ch["delta"])
	if err != nil {
		return
	}
	a.anyDelta = true
	if r := delta.str("role"); r != "" {
		a.role = r
	}
	var s string
	if json.Unmarshal(delta["content"], &s) == nil {
		a.content.WriteString(s)
	}
	var tcs []obj
	_ = json.Unmarshal(delta["tool_calls"], &tcs)
	for i, tc := range tcs {
		a.addToolCall(i, tc)
	}
}

// addToolCall merges the i-th tool call of a delta (its index says which
// call it continues).
func (a *chatAssembly) addToolCall(i int, tc obj) {
	idx := i
	_ = json.Unmarshal(tc["index"], &idx)
	cur, ok := a.calls[idx]
	if !ok {
		cur = obj{}
		a.calls[idx] = cur
		a.args[idx] = &strings.Builder{}
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
		var s string
		if json.Unmarshal(fn["arguments"], &s) == nil {
			a.args[idx].WriteString(s)
		}
	}
}

// completion is the chat.completion the chunks make.
func (a *chatAssembly) completion() ([]byte, error) {
	if a.top == nil || !a.anyDelta {
		return nil, errors.New("stream held no chat completion chunk")
	}
	msg := obj{"role": raw(a.role)}
	if a.content.Len() > 0 || len(a.calls) == 0 {
		msg["content"] = raw(a.content.String())
	}
	if len(a.calls) > 0 {
		idx := make([]int, 0, len(a.calls))
		for i := range a.calls {
			idx = append(idx, i)
		}
		sort.Ints(idx)
		var list []obj
		for _, i := range idx {
			c := a.calls[i]
			t := c["type"]
			if t == nil {
				t = raw("function")
			}
			tc := obj{"id": c["id"], "type": t, "function": raw(obj{"name": c["name"], "arguments": raw(a.args[i].String())})}
			list = append(list, tc)
		}
		msg["tool_calls"] = raw(list)
	}
	finish := a.finish
	if finish == nil {
		finish = raw("stop")
	}
	choice := obj{"index": raw(0), "message": raw(msg), "finish_reason": finish}
	for k, v := range a.extras {
		choice[k] = v
	}
	top := a.top
	top["object"] = raw("chat.completion")
	top["choices"] = raw([]obj{choice})
	if a.usage != nil {
		top["usage"] = a.usage
	}
	return json.Marshal(top)
}

// isNull reports whether a member is absent or JSON null.
func isNull(v json.RawMessage) bool {
	return v == nil || string(bytes.TrimSpace(v)) == "null"
}

// strField reads member k as a string: ok is false when it is present and
// not a string; absent and null read as "".
func (o obj) strField(k string) (string, bool) {
	if isNull(o[k]) {
		return "", true
	}
	var s string
	return s, json.Unmarshal(o[k], &s) == nil
}

// strOr reads member k as a string, def when it is absent, null or "";
// the error says that where.k is not a string.
func (o obj) strOr(k, def, where string) (string, error) {
	v, ok := o.strField(k)
	if !ok {
		return "", fmt.Errorf("%s.%s is not a string", where, k)
	}
	if v == "" {
		v = def
	}
	return v, nil
}

// objList reads member k as a list of objects; absent and null read as an
// empty list.
func (o obj) objList(k string) ([]obj, error) {
	if isNull(o[k]) {
		return nil, nil
	}
	var raws []json.RawMessage
	if err := json.Unmarshal(o[k], &raws); err != nil {
		return nil, fmt.Errorf("%q is not a list", k)
	}
	out := make([]obj, len(raws))
	for i, r := range raws {
		v, err := decodeObj(r)
		if err != nil {
			return nil, fmt.Errorf("%s[%d]: %w", k, i, err)
		}
		out[i] = v
	}
	return out, nil
}

func (o obj) clone() obj {
	c := make(obj, len(o))
	for k, v := range o {
		c[k] = v
	}
	return c
}

func isJSONArray(v json.RawMessage) bool {
	v = bytes.TrimSpace(v)
	return len(v) > 0 && v[0] == '['
}

// sseWriter writes events in the text/event-stream framing.
type sseWriter struct{ bytes.Buffer }

func (w *sseWriter) data(o obj) {
	b, _ := json.Marshal(o)
	w.WriteString("data: ")
	w.Write(b)
	w.WriteString("\n\n")
}

func (w *sseWriter) named(name string, o obj) {
	b, _ := json.Marshal(o)
	fmt.Fprintf(w, "event: %s\ndata: %s\n\n", name, b)
}

// chatChunkHead are the members every chat.completion.chunk repeats from
// the completion.
var chatChunkHead = []string{"id", "created", "model", "system_fingerprint", "service_tier"}

// ChatChunks turns a whole chat.completion into the SSE body a streaming
// client of the Chat Completions API expects. Per choice, in order: a chunk
// whose delta opens the message (role, content "", refusal null, and any
// message member this package does not stream, such as vLLM's
// reasoning_content), a content chunk, a refusal chunk, for each tool call
// a chunk opening it (index, id, type, function name, arguments "") and a
// chunk with its arguments, and a chunk with an empty delta and the
// finish_reason. The choice's logprobs and its other members (vLLM's
// token_ids) ride on its first chunk that carries generated text; the
// completion's members other than id, created, model, system_fingerprint
// and service_tier (which every chunk repeats) ride on the first chunk
// only (vLLM's prompt_token_ids). With includeUsage every chunk carries
// "usage": null and a last chunk with no choices carries the usage. The
// body ends with "data: [DONE]".
func ChatChunks(completion []byte, includeUsage bool) ([]byte, error) {
	c, err := decodeObj(completion)
	if err != nil {
		return nil, fmt.Errorf("completion: %w", err)
	}
	choices, err := checkChatCompletion(c)
	if err != nil {
		return nil, err
	}
	var chunks []chatChunk
	for i, ch := range choices {
		cs, err := choiceChunks(i, ch)
		if err != nil {
			return nil, err
		}
		chunks = append(chunks, cs...)
	}
	return writeChatChunks(c, chunks, includeUsage), nil
}

// checkChatCompletion refuses a completion ChatChunks cannot stream for
// what it says about itself, and returns its choices.
func checkChatCompletion(c obj) ([]obj, error) {
	if isNull(c["choices"]) {
		return nil, errors.New(`completion has no "choices"`)
	}
	choices, err := c.objList("choices")
	if err != nil {
		return nil, fmt.Errorf("completion: %w", err)
	}
	if id, ok := c.strField("id"); !ok || id == "" {
		return nil, errors.New(`completion "id" is not a string`)
	}
	if _, ok := c.strField("model"); !ok {
		return nil, errors.New(`completion "model" is not a string`)
	}
	var created float64
	if err := json.Unmarshal(c["created"], &created); err != nil {
		return nil, errors.New(`completion "created" is not a number`)
	}
	return choices, nil
}

// chatChunk is one chunk of a choice: the choice's members and its delta.
type chatChunk struct {
	choice obj
	delta  obj
}

// choiceStream gathers the chunks of choice i.
type choiceStream struct {
	i        int
	rest     obj             // the choice's members that are not streamed piecewise
	logprobs json.RawMessage // the choice's logprobs
	placed   bool            // rest and logprobs went on a chunk already
	chunks   []chatChunk
}

// frame is a chunk's choice members with finish_reason finish.
func (s *choiceStream) frame(finish json.RawMessage) obj {
	return obj{"index": raw(s.i), "finish_reason": finish, "logprobs": raw(nil)}
}

// add adds a chunk that carries no generated text.
func (s *choiceStream) add(choice, delta obj) {
	s.chunks = append(s.chunks, chatChunk{choice, delta})
}

// text adds a chunk that carries generated text: the first one takes the
// choice's logprobs and other members.
func (s *choiceStream) text(delta obj) {
	one := s.frame(raw(nil))
	if !s.placed {
		for k, v := range s.rest {
			one[k] = v
		}
		one["logprobs"] = s.logprobs
		s.placed = true
	}
	s.add(one, delta)
}

// choiceChunks checks choice i and returns its chunks.
func choiceChunks(i int, ch obj) ([]chatChunk, error) {
	if v, ok := ch["index"]; ok {
		var idx int
		if json.Unmarshal(v, &idx) != nil || idx != i {
			return nil, fmt.Errorf("choices[%d] has index %s", i, v)
		}
	}
	msg := obj{}
	if !isNull(ch["message"]) {
		var err error
		if msg, err = decodeObj(ch["message"]); err != nil {
			return nil, fmt.Errorf("choices[%d].message: %w", i, err)
		}
	}
	where := fmt.Sprintf("choices[%d].message", i)
	role, err := msg.strOr("role", "assistant", where)
	if err != nil {
		return nil, err
	}
	if role != "assistant" {
		return nil, fmt.Errorf("choices[%d].message.role is %q, not assistant", i, role)
	}
	content, err := msg.strOr("content", "", where)
	if err != nil {
		return nil, err
	}
	refusal, err := msg.strOr("refusal", "", where)
	if err != nil {
		return nil, err
	}
	calls, err := msg.objList("tool_calls")
	if err != nil {
		return nil, fmt.Errorf("choices[%d].message: %w", i, err)
	}
	finish, err := ch.strOr("finish_reason", "stop", fmt.Sprintf("choices[%d]", i))
	if err != nil {
		return nil, err
	}
	s := &choiceStream{i: i, rest: obj{}, logprobs: ch["logprobs"]}
	for k, v := range ch {
		if k != "index" && k != "message" && k != "finish_reason" && k != "logprobs" {
			s.rest[k] = v
		}
	}
	if s.logprobs == nil {
		s.logprobs = raw(nil)
	}
	open := obj{"role": raw(role), "content": raw(""), "refusal": raw(nil)}
	for k, v := range msg {
		if k != "role" && k != "content" && k != "refusal" && k != "tool_calls" {
			open[k] = v
		}
	}
	if content == "" && refusal == "" && len(calls) == 0 {
		s.text(open)
	} else {
		s.add(s.frame(raw(nil)), open)
	}
	if content != "" {
		s.text(obj{"content": raw(content)})
	}
	if refusal != "" {
		s.text(obj{"refusal": raw(refusal)})
	}
	for j, tc := range calls {
		if err := s.toolCall(j, tc); err != nil {
			return nil, err
		}
	}
	s.add(s.frame(raw(finish)), obj{})
	return s.chunks, nil
}

// toolCall adds the chunks of the choice's tool call j: one opening it
// (index, id, type, function name, arguments "") and one with its
// arguments; a call of another type than function goes whole.
func (s *choiceStream) toolCall(j int, tc obj) error {
	where := fmt.Sprintf("choices[%d].message.tool_calls[%d]", s.i, j)
	id, ok := tc.strField("id")
	if !ok || id == "" {
		return fmt.Errorf("%s.id is not a string", where)
	}
	typ, err := tc.strOr("type", "function", where)
	if err != nil {
		return err
	}
	if typ != "function" {
		// Another kind of call (a custom tool's, say) goes whole.
		d := tc.clone()
		d["index"], d["type"] = raw(j), raw(typ)
		s.text(obj{"tool_calls": raw([]obj{d})})
		return nil
	}
	fn := obj{}
	if !isNull(tc["function"]) {
		if fn, err = decodeObj(tc["function"]); err != nil {
			return fmt.Errorf("%s.function: %w", where, err)
		}
	}
	name, ok := fn.strField("name")
	if !ok || name == "" {
		return fmt.Errorf("%s.function.name is not a string", where)
	}
	args, err := fn.strOr("arguments", "", where+".function")
	if err != nil {
		return err
	}
	openFn := fn.clone()
	openFn["arguments"] = raw("")
	openCall := obj{"index": raw(j), "id": raw(id), "type": raw(typ), "function": raw(openFn)}
	for k, v := range tc {
		if k != "id" && k != "type" && k != "function" && k != "index" {
			openCall[k] = v
		}
	}
	s.text(obj{"tool_calls": raw([]obj{openCall})})
	if args != "" {
		more := obj{"index": raw(j), "function": raw(obj{"arguments": raw(args)})}
		s.text(obj{"tool_calls": raw([]obj{more})})
	}
	return nil
}

// writeChatChunks writes the chunks of completion c as events: each
// repeats the completion's head members, the first also carries its other
// members, and with includeUsage every chunk carries "usage": null and a
// last one with no choices the usage. The body ends with "data: [DONE]".
func writeChatChunks(c obj, chunks []chatChunk, includeUsage bool) []byte {
	head := obj{"object": raw("chat.completion.chunk")}
	for _, k := range chatChunkHead {
		if v, ok := c[k]; ok {
			head[k] = v
		}
	}
	if _, ok := head["model"]; !ok {
		head["model"] = raw("")
	}
	firstOnly := obj{}
	for k, v := range c {
		if _, ok := head[k]; !ok && k != "choices" && k != "usage" {
			firstOnly[k] = v
		}
	}
	// chunk is the n-th chunk's completion members.
	chunk := func(n int) obj {
		o := head.clone()
		if n == 0 {
			for k, v := range firstOnly {
				o[k] = v
			}
		}
		return o
	}
	var w sseWriter
	for n, ch := range chunks {
		o := chunk(n)
		ch.choice["delta"] = raw(ch.delta)
		o["choices"] = raw([]obj{ch.choice})
		if includeUsage {
			o["usage"] = raw(nil)
		}
		w.data(o)
	}
	if len(chunks) == 0 && !includeUsage {
		// No choice at all: one chunk with none still names the completion.
		o := chunk(0)
		o["choices"] = raw([]obj{})
		w.data(o)
	}
	if includeUsage {
		o := chunk(len(chunks))
		o["choices"] = raw([]obj{})
		u := c["usage"]
		if u == nil {
			u = raw(nil)
		}
		o["usage"] = u
		w.data(o)
	}
	w.WriteString("data: [DONE]\n\n")
	return w.Bytes()
}

// responsesEmitter numbers the events of one Responses stream.
type responsesEmitter struct {
	w   sseWriter
	seq int
}

func (e *responsesEmitter) emit(typ string, o obj) {
	o["type"] = raw(typ)
	o["sequence_number"] = raw(e.seq)
	e.seq++
	e.w.named(typ, o)
}

// ResponsesEvents turns a whole Responses-API response object into the
// events of the Responses streaming format, numbered from 0:
// response.created and response.in_progress (the response in progress:
// no output, no usage), then per output item response.output_item.added
// (the item in progress, its text empty), the events that stream its text
// (content parts, text and refusal deltas, function-call arguments,
// reasoning summary and reasoning text, custom-tool input; one delta per
// piece of text) and response.output_item.done with the item as given,
// and last response.completed with the whole response, or
// response.incomplete or response.failed when that is its status. It
// refuses a response that is not finished (queued, in_progress) and items
// whose text is not where the format puts it.
func ResponsesEvents(response []byte) ([]byte, error) {
	r, err := decodeObj(response)
	if err != nil {
		return nil, fmt.Errorf("response: %w", err)
	}
	if id, ok := r.strField("id"); !ok || id == "" {
		return nil, errors.New(`response "id" is not a string`)
	}
	status, ok := r.strField("status")
	if !ok {
		return nil, errors.New(`response "status" is not a string`)
	}
	terminal := "response.completed"
	switch status {
	case "queued", "in_progress":
		return nil, fmt.Errorf("response is %s, not finished", status)
	case "incomplete":
		terminal = "response.incomplete"
	case "failed":
		terminal = "response.failed"
	}
	if !isJSONArray(r["output"]) {
		return nil, errors.New(`response "output" is not a list`)
	}
	items, err := r.objList("output")
	if err != nil {
		return nil, fmt.Errorf("response: %w", err)
	}
	// Check every item before the first event, so a refusal is whole.
	for i, it := range items {
		if err := checkResponseItem(it); err != nil {
			return nil, fmt.Errorf("response output[%d]: %w", i, err)
		}
	}
	start := r.clone()
	start["status"] = raw("in_progress")
	start["output"] = raw([]obj{})
	start["usage"] = raw(nil)
	for _, k := range []string{"error", "incomplete_details", "completed_at"} {
		if _, ok := start[k]; ok {
			start[k] = raw(nil)
		}
	}
	// What describes the finished generation is not known at its start:
	// the SDK's output_text convenience, and the token ids vLLM and SGLang
	// add (they come with response.completed).
	for _, k := range []string{"output_text", "token_ids", "prompt_token_ids"} {
		delete(start, k)
	}
	var e responsesEmitter
	e.emit("response.created", obj{"response": raw(start)})
	e.emit("response.in_progress", obj{"response": raw(start)})
	for i, it := range items {
		streamResponseItem(&e, i, it)
	}
	e.emit(terminal, obj{"response": raw(r)})
	return e.w.Bytes(), nil
}

// checkResponseItem refuses an item ResponsesEvents cannot stream.
func checkResponseItem(it obj) error {
	typ, ok := it.strField("type")
	if !ok || typ == "" {
		return errors.New(`"type" is not a string`)
	}
	if _, ok := it.strField("status"); !ok {
		return errors.New(`"status" is not a string`)
	}
	streamed := true
	switch typ {
	case "message":
		parts, err := it.objList("content")
		if err != nil {
			return err
		}
		for j, p := range parts {
			pt, ok := p.strField("type")
			if !ok || pt == "" {
				return fmt.Errorf(`content[%d]: "type" is not a string`, j)
			}
			if pt == "output_text" || pt == "refusal" {
				k := map[string]string{"output_text": "text", "refusal": "refusal"}[pt]
				if _, ok := p.strField(k); !ok || isNull(p[k]) {
					return fmt.Errorf(`content[%d]: %q is not a string`, j, k)
				}
			}
			if !isNull(p["annotations"]) && !isJSONArray(p["annotations"]) {
				return fmt.Errorf(`content[%d]: "annotations" is not a list`, j)
			}
		}
	case "function_call":
		for _, k := range []string{"name", "arguments"} {
			if _, ok := it.strField(k); !ok || isNull(it[k]) {
				return fmt.Errorf("%q is not a string", k)
			}
		}
	case "custom_tool_call":
		if _, ok := it.strField("input"); !ok || isNull(it["input"]) {
			return errors.New(`"input" is not a string`)
		}
	case "reasoning":
		for _, k := range []string{"summary", "content"} {
			parts, err := it.objList(k)
			if err != nil {
				return err
			}
			for j, p := range parts {
				if _, ok := p.strField("text"); !ok || isNull(p["text"]) {
					return fmt.Errorf(`%s[%d]: "text" is not a string`, k, j)
				}
				if pt, ok := p.strField("type"); !ok || (k == "content" && pt != "reasoning_text") {
					return fmt.Errorf(`%s[%d]: "type" is %s`, k, j, p["type"])
				}
			}
		}
	default:
		streamed = false
	}
	if streamed {
		if id, ok := it.strField("id"); !ok || id == "" {
			return errors.New(`"id" is not a string`)
		}
	}
	return nil
}

// streamReasoningParts streams a reasoning item's summary or content
// parts: per part, PART.added (the part with its text empty), TEXT.delta
// (when there is text), TEXT.done and PART.done, each with the part's
// index under indexKey.
func streamReasoningParts(e *responsesEmitter, at func(obj) obj, parts []obj, indexKey, part, text string) {
	for j, p := range parts {
		in := func(o obj) obj {
			o = at(o)
			o[indexKey] = raw(j)
			return o
		}
		t := p.str("text")
		empty := p.clone()
		empty["text"] = raw("")
		e.emit(part+".added", in(obj{"part": raw(empty)}))
		if t != "" {
			e.emit(text+".delta", in(obj{"delta": raw(t)}))
		}
		e.emit(text+".done", in(obj{"text": raw(t)}))
		e.emit(part+".done", in(obj{"part": raw(p)}))
	}
}

// streamMessageParts streams a message item's content parts: per part,
// response.content_part.added, the text or refusal deltas and their done
// event, and response.content_part.done, each with the part's index.
func streamMessageParts(e *responsesEmitter, at func(obj) obj, parts []obj) {
	for j, p := range parts {
		in := func(o obj) obj {
			o = at(o)
			o["content_index"] = raw(j)
			return o
		}
		switch p.str("type") {
		case "output_text":
			text := p.str("text")
			lps := p["logprobs"]
			if !isJSONArray(lps) {
				lps = raw([]any{})
			}
			e.emit("response.content_part.added", in(obj{"part": raw(obj{"type": raw("output_text"), "text": raw(""), "annotations": raw([]any{}), "logprobs": raw([]any{})})}))
			if text != "" {
				e.emit("response.output_text.delta", in(obj{"delta": raw(text), "logprobs": lps}))
			}
			var anns []json.RawMessage
			_ = json.Unmarshal(p["annotations"], &anns)
			for k, a := range anns {
				e.emit("response.output_text.annotation.added", in(obj{"annotation_index": raw(k), "annotation": a}))
			}
			e.emit("response.output_text.done", in(obj{"text": raw(text), "logprobs": lps}))
		case "refusal":
			text := p.str("refusal")
			e.emit("response.content_part.added", in(obj{"part": raw(obj{"type": raw("refusal"), "refusal": raw("")})}))
			if text != "" {
				e.emit("response.refusal.delta", in(obj{"delta": raw(text)}))
			}
			e.emit("response.refusal.done", in(obj{"refusal": raw(text)}))
		default:
			e.emit("response.content_part.added", in(obj{"part": raw(p)}))
		}
		e.emit("response.content_part.done", in(obj{"part": raw(p)}))
	}
}

// streamResponseItem emits the events of output item i (checked by
// checkResponseItem).
func streamResponseItem(e *responsesEmitter, i int, it obj) {
	typ := it.str("type")
	added := it.clone()
	if _, ok := it["status"]; ok {
		added["status"] = raw("in_progress")
	}
	at := func(o obj) obj {
		o["item_id"] = it["id"]
		o["output_index"] = raw(i)
		return o
	}
	switch typ {
	case "message":
		parts, _ := it.objList("content")
		added["content"] = raw([]obj{})
		e.emit("response.output_item.added", obj{"output_index": raw(i), "item": raw(added)})
		streamMessageParts(e, at, parts)
	case "function_call":
		streamCallInput(e, at, i, it, added, "arguments", "response.function_call_arguments", obj{"name": it["name"]})
	case "custom_tool_call":
		streamCallInput(e, at, i, it, added, "input", "response.custom_tool_call_input", obj{})
	case "reasoning":
		summary, _ := it.objList("summary")
		content, _ := it.objList("content")
		added["summary"] = raw([]obj{})
		if !isNull(it["content"]) {
			added["content"] = raw([]obj{})
		}
		e.emit("response.output_item.added", obj{"output_index": raw(i), "item": raw(added)})
		streamReasoningParts(e, at, summary, "summary_index", "response.reasoning_summary_part", "response.reasoning_summary_text")
		streamReasoningParts(e, at, content, "content_index", "response.content_part", "response.reasoning_text")
	default:
		e.emit("response.output_item.added", obj{"output_index": raw(i), "item": raw(added)})
	}
	e.emit("response.output_item.done", obj{"output_index": raw(i), "item": raw(it)})
}

// streamCallInput streams output item i, a call whose input is its
// member k: the item added with k empty, a delta event with the input
// (unless it is empty) and a done event with done's members and k.
func streamCallInput(e *responsesEmitter, at func(obj) obj, i int, it, added obj, k, event string, done obj) {
	input := it.str(k)
	added[k] = raw("")
	e.emit("response.output_item.added", obj{"output_index": raw(i), "item": raw(added)})
	if input != "" {
		e.emit(event+".delta", at(obj{"delta": raw(input)}))
	}
	done[k] = raw(input)
	e.emit(event+".done", at(done))
}

// upstreamError reads an OpenAI-style error body ({"error": {"message",
// "type", "code", "param"}}); members it lacks come from the status.
func upstreamError(status int, body []byte) (message, typ string, code, param json.RawMessage) {
	var e struct {
		Error struct {
			Message json.RawMessage `json:"message"`
			Type    json.RawMessage `json:"type"`
			Code    json.RawMessage `json:"code"`
			Param   json.RawMessage `json:"param"`
		} `json:"error"`
	}
	_ = json.Unmarshal(body, &e)
	str := func(v json.RawMessage) (string, bool) {
		var s string
		return s, !isNull(v) && json.Unmarshal(v, &s) == nil
	}
	message, ok := str(e.Error.Message)
	if !ok || message == "" {
		text := strings.TrimSpace(string(body))
		if len(text) > 512 {
			text = text[:512] + "…"
		}
		message = fmt.Sprintf("upstream answered %d", status)
		if text != "" {
			message += ": " + text
		}
	}
	typ, ok = str(e.Error.Type)
	if !ok || typ == "" {
		switch {
		case status == 429:
			typ = "rate_limit_error"
		case status >= 500 || status == 0:
			typ = "server_error"
		default:
			typ = "upstream_error"
		}
	}
	code = raw(nil)
	if s, ok := str(e.Error.Code); ok {
		code = raw(s)
	} else if c := bytes.TrimSpace(e.Error.Code); len(c) > 0 && c[0] >= '0' && c[0] <= '9' {
		// OpenAI-compatible servers send numeric codes; keep them as text.
		code = raw(string(c))
	} else if status != 0 {
		code = raw(fmt.Sprint(status))
	}
	param = raw(nil)
	if s, ok := str(e.Error.Param); ok {
		param = raw(s)
	}
	return message, typ, code, param
}

// ChatStreamError is the event that ends a Chat Completions stream whose
// call failed after the stream's headers were sent (the relay answers a
// stream's headers at once and keeps the connection alive with comments
// while it waits): one "data:" event holding {"error": {message, type,
// code, param}}, the shape of an OpenAI error body, and no "[DONE]" after
// it. The official SDKs raise an API error on a stream chunk with an
// "error" member. message, type, code and param come from body when it is
// an OpenAI-style error; what it lacks is made from status (code is the
// status as text).
func ChatStreamError(status int, body []byte) []byte {
	message, typ, code, param := upstreamError(status, body)
	var w sseWriter
	w.data(obj{"error": raw(obj{"message": raw(message), "type": raw(typ), "code": code, "param": param})})
	return w.Bytes()
}

// ResponsesStreamError is the event that ends a Responses stream whose call
// failed after the stream's headers were sent: "event: error" with
// {"type": "error", "code", "message", "param", "sequence_number": seq},
// seq being the number of events already sent on the stream. The fields
// come from body as in ChatStreamError.
func ResponsesStreamError(status int, body []byte, seq int) []byte {
	message, _, code, param := upstreamError(status, body)
	var w sseWriter
	w.named("error", obj{"type": raw("error"), "code": code, "message": raw(message), "param": param, "sequence_number": raw(seq)})
	return w.Bytes()
}
