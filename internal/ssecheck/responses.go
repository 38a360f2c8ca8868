package ssecheck

import (
	"encoding/json"
	"errors"
	"fmt"
)

// respEvent is one decoded event of a Responses stream.
type respEvent struct {
	n    int
	typ  string
	data obj
}

// respCheck walks a Responses stream, rebuilding the output from the
// deltas as it goes.
type respCheck struct {
	evs      []respEvent
	pos      int
	id       string
	built    []any // the items rebuilt from added events and deltas
	final    obj   // the terminal event's response
	errEvent obj
}

func (r *respCheck) peek() *respEvent {
	if r.pos < len(r.evs) {
		return &r.evs[r.pos]
	}
	return nil
}

// next takes the next event, which must be of type typ and (when item is
// not nil) belong to output index i and to item id.
func (r *respCheck) next(typ string, i int, item obj) (obj, error) {
	e := r.peek()
	if e == nil {
		return nil, fmt.Errorf("the stream ends where %s was due", typ)
	}
	if e.typ != typ {
		return nil, fmt.Errorf("event %d: %s where %s was due", e.n, e.typ, typ)
	}
	r.pos++
	if item != nil {
		if oi, ok := isInt(e.data["output_index"]); !ok || oi != i {
			return nil, fmt.Errorf("event %d (%s): output_index %s, want %d", e.n, typ, canon(e.data["output_index"]), i)
		}
		if _, ok := e.data["item"]; !ok {
			if id, _ := str(e.data, "item_id"); id != item["id"] {
				return nil, fmt.Errorf("event %d (%s): item_id %s, want %s", e.n, typ, canon(e.data["item_id"]), canon(item["id"]))
			}
		}
	}
	return e.data, nil
}

func (r *respCheck) is(typ string) bool {
	e := r.peek()
	return e != nil && e.typ == typ
}

// index checks member k of an event against want.
func index(d obj, k string, want int) error {
	if v, ok := isInt(d[k]); !ok || v != want {
		return fmt.Errorf("%s %s, want %d", k, canon(d[k]), want)
	}
	return nil
}

func strMember(d obj, k string) (string, error) {
	s, ok := str(d, k)
	if !ok {
		return "", fmt.Errorf("%s is %s, not a string", k, canon(d[k]))
	}
	return s, nil
}

// CheckResponses checks a Responses stream: named events whose name is
// their data's type, sequence_number consecutive from 0, no [DONE];
// response.created then response.in_progress, both with the response in
// progress (status "in_progress", output empty, usage null); the output
// items one after another, in output_index order: output_item.added with
// the item in progress (status "in_progress" where it has one) and empty
// (a message's content, a function call's arguments, a custom tool call's
// input, a reasoning item's summary and content), then its text events
// with the item's item_id and output_index (content parts added empty,
// text, refusal, arguments, input, reasoning summary and reasoning text
// deltas whose concatenation is what the .done event and the part's
// .done event say, annotations added in order), then output_item.done
// with the same item, no longer in progress, whose text is what the deltas
// built; last response.completed, response.incomplete or response.failed
// with a response of that status, the same id, and the output the items'
// done events gave, and nothing after it. A stream may instead end with an
// "error" event (type "error", message, code and param strings or null).
func CheckResponses(stream []byte) error {
	_, err := checkResponses(stream)
	return err
}

func checkResponses(stream []byte) (*respCheck, error) {
	s, err := Parse(stream)
	if err != nil {
		return nil, err
	}
	if s.Done {
		return nil, errors.New("a Responses stream holds no [DONE]")
	}
	r := &respCheck{}
	for n, ev := range s.Events {
		d, err := decode(ev.Data)
		if err != nil {
			return nil, fmt.Errorf("event %d: %w", n, err)
		}
		typ, _ := str(d, "type")
		if typ == "" || ev.Name != typ {
			return nil, fmt.Errorf("event %d: named %q, type %s", n, ev.Name, canon(d["type"]))
		}
		if err := index(d, "sequence_number", n); err != nil {
			return nil, fmt.Errorf("event %d (%s): %w", n, typ, err)
		}
		if typ == "error" {
			if n != len(s.Events)-1 {
				return nil, fmt.Errorf("event %d: events after the error event", n)
			}
			if _, ok := str(d, "message"); !ok {
				return nil, fmt.Errorf("event %d: error without a message", n)
			}
			for _, k := range []string{"code", "param"} {
				if v, ok := d[k]; !ok || (v != nil && !isString(v)) {
					return nil, fmt.Errorf("event %d: error %s is %s", n, k, canon(v))
				}
			}
			r.errEvent = d
			s.Events = s.Events[:n]
			break
		}
		r.evs = append(r.evs, respEvent{n: n, typ: typ, data: d})
	}
	if err := r.walk(); err != nil {
		if r.errEvent != nil && r.pos == len(r.evs) {
			return r, nil // cut short by the error event
		}
		return nil, err
	}
	return r, nil
}

func isString(v any) bool { _, ok := v.(string); return ok }

func (r *respCheck) walk() error {
	for k, typ := range []string{"response.created", "response.in_progress"} {
		d, err := r.next(typ, 0, nil)
		if err != nil {
			return err
		}
		resp, ok := d["response"].(obj)
		if !ok {
			return fmt.Errorf("%s: no response object", typ)
		}
		id, _ := str(resp, "id")
		if id == "" {
			return fmt.Errorf("%s: the response has no id", typ)
		}
		if k == 0 {
			r.id = id
		} else if id != r.id {
			return fmt.Errorf("%s: response id %s, created said %s", typ, id, r.id)
		}
		if st, _ := str(resp, "status"); st != "in_progress" {
			return fmt.Errorf("%s: status %s, want in_progress", typ, canon(resp["status"]))
		}
		if out, ok := resp["output"].([]any); !ok || len(out) != 0 {
			return fmt.Errorf("%s: output %s, want []", typ, canon(resp["output"]))
		}
		if resp["usage"] != nil {
			return fmt.Errorf("%s: usage %s, want null", typ, canon(resp["usage"]))
		}
	}
	var done []any
	for i := 0; r.is("response.output_item.added"); i++ {
		item, err := r.item(i)
		if err != nil {
			return err
		}
		done = append(done, item)
	}
	e := r.peek()
	if e == nil {
		return errors.New("the stream ends without response.completed, .incomplete or .failed")
	}
	want := map[string]string{"response.completed": "completed", "response.incomplete": "incomplete", "response.failed": "failed"}
	st, ok := want[e.typ]
	if !ok {
		return fmt.Errorf("event %d: %s where an output item or the end was due", e.n, e.typ)
	}
	r.pos++
	resp, ok := e.data["response"].(obj)
	if !ok {
		return fmt.Errorf("%s: no response object", e.typ)
	}
	got, _ := str(resp, "status")
	if e.typ == "response.completed" {
		if got == "in_progress" || got == "queued" || got == "incomplete" || got == "failed" {
			return fmt.Errorf("%s: status %s", e.typ, got)
		}
	} else if got != st {
		return fmt.Errorf("%s: status %s, want %s", e.typ, canon(resp["status"]), st)
	}
	if id, _ := str(resp, "id"); id != r.id {
		return fmt.Errorf("%s: response id %s, created said %s", e.typ, id, r.id)
	}
	if done == nil {
		done = []any{}
	}
	if out, ok := resp["output"].([]any); !ok || canon(out) != canon(done) {
		return fmt.Errorf("%s: output %s\n  the items' done events gave %s", e.typ, canon(resp["output"]), canon(done))
	}
	if r.pos != len(r.evs) {
		return fmt.Errorf("event %d: %s after %s", r.evs[r.pos].n, r.evs[r.pos].typ, e.typ)
	}
	r.final = resp
	return nil
}

// item checks output item i's events and returns the item its done event
// gave.
func (r *respCheck) item(i int) (obj, error) {
	d, err := r.next("response.output_item.added", i, nil)
	if err != nil {
		return nil, err
	}
	if err := index(d, "output_index", i); err != nil {
		return nil, fmt.Errorf("output_item.added: %w", err)
	}
	added, ok := d["item"].(obj)
	if !ok {
		return nil, errors.New("output_item.added: no item object")
	}
	typ, _ := str(added, "type")
	if typ == "" {
		return nil, fmt.Errorf("output_item.added %d: item without a type", i)
	}
	fail := func(err error) (obj, error) { return nil, fmt.Errorf("output %d (%s): %w", i, typ, err) }
	if st, ok := added["status"]; ok && st != "in_progress" {
		return fail(fmt.Errorf("added with status %s", canon(st)))
	}
	built := deepCopy(added).(obj)
	r.built = append(r.built, built)
	if err := addedEmpty(typ, added); err != nil {
		return fail(err)
	}
	if err := r.itemContent(i, typ, added, built); err != nil {
		return fail(err)
	}
	d, err = r.next("response.output_item.done", i, nil)
	if err != nil {
		return fail(err)
	}
	if err := index(d, "output_index", i); err != nil {
		return fail(err)
	}
	item, ok := d["item"].(obj)
	if !ok {
		return fail(errors.New("output_item.done: no item object"))
	}
	if item["type"] != typ || canon(item["id"]) != canon(added["id"]) {
		return fail(fmt.Errorf("done item %s %s is not the added one", canon(item["type"]), canon(item["id"])))
	}
	if item["status"] == "in_progress" {
		return fail(errors.New("done item still in_progress"))
	}
	if err := sameText(typ, item, built); err != nil {
		return fail(err)
	}
	r.built[i] = mergeDone(typ, item, built)
	return item, nil
}

// addedEmpty checks that an added item of a type that is streamed has an
// id and nothing yet of what is streamed.
func addedEmpty(typ string, added obj) error {
	empty := map[string]string{"message": "content", "function_call": "arguments", "custom_tool_call": "input", "reasoning": "summary"}
	k, ok := empty[typ]
	if !ok {
		return nil
	}
	if id, _ := str(added, "id"); id == "" {
		return errors.New("added without an id")
	}
	v := added[k]
	if l, ok := v.([]any); (ok && len(l) != 0) || (!ok && v != "") {
		return fmt.Errorf("added with %s %s, not empty", k, canon(v))
	}
	if typ == "reasoning" {
		if l, ok := added["content"].([]any); (ok && len(l) != 0) || (!ok && added["content"] != nil) {
			return fmt.Errorf("added with content %s, not empty", canon(added["content"]))
		}
	}
	return nil
}

// itemContent checks the events between item i's added and done events:
// its parts, or its streamed arguments or input, built into built.
func (r *respCheck) itemContent(i int, typ string, added, built obj) error {
	switch typ {
	case "message":
		for j := 0; r.is("response.content_part.added"); j++ {
			if err := r.part(i, j, added, built, "content"); err != nil {
				return err
			}
		}
	case "reasoning":
		for j := 0; r.is("response.reasoning_summary_part.added"); j++ {
			if err := r.part(i, j, added, built, "summary"); err != nil {
				return err
			}
		}
		for j := 0; r.is("response.content_part.added"); j++ {
			if err := r.part(i, j, added, built, "content"); err != nil {
				return err
			}
		}
	case "function_call", "custom_tool_call":
		k, ev := "arguments", "response.function_call_arguments"
		if typ == "custom_tool_call" {
			k, ev = "input", "response.custom_tool_call_input"
		}
		text, err := r.text(i, added, ev, "", -1, k)
		if err != nil {
			return err
		}
		built[k] = text
	}
	return nil
}

// text checks the deltas and the done event of one piece of text (ev is
// the event prefix; k the member the done event names it by) and returns
// it. Logprobs of output_text deltas are checked and gathered into lps.
func (r *respCheck) text(i int, item obj, ev, idxKey string, j int, k string) (string, error) {
	text := ""
	for r.is(ev + ".delta") {
		d, _ := r.next(ev+".delta", i, item)
		if idxKey != "" {
			if err := index(d, idxKey, j); err != nil {
				return "", fmt.Errorf("%s.delta: %w", ev, err)
			}
		}
		s, err := strMember(d, "delta")
		if err != nil {
			return "", fmt.Errorf("%s.delta: %w", ev, err)
		}
		text += s
	}
	d, err := r.next(ev+".done", i, item)
	if err != nil {
		return "", err
	}
	if idxKey != "" {
		if err := index(d, idxKey, j); err != nil {
			return "", fmt.Errorf("%s.done: %w", ev, err)
		}
	}
	s, err := strMember(d, k)
	if err != nil {
		return "", fmt.Errorf("%s.done: %w", ev, err)
	}
	if s != text {
		return "", fmt.Errorf("%s.done says %q, the deltas %q", ev, s, text)
	}
	if ev == "response.function_call_arguments" {
		if n, ok := item["name"]; ok && d["name"] != n {
			return "", fmt.Errorf("%s.done: name %s, the item's %s", ev, canon(d["name"]), canon(n))
		}
	}
	return text, nil
}

// part checks content part (list "content") or summary part (list
// "summary") j of item i.
func (r *respCheck) part(i, j int, item, built obj, list string) error {
	addedEv, doneEv, idxKey := "response.content_part.added", "response.content_part.done", "content_index"
	if list == "summary" {
		addedEv, doneEv, idxKey = "response.reasoning_summary_part.added", "response.reasoning_summary_part.done", "summary_index"
	}
	d, err := r.next(addedEv, i, item)
	if err != nil {
		return err
	}
	if err := index(d, idxKey, j); err != nil {
		return fmt.Errorf("%s: %w", addedEv, err)
	}
	p, ok := d["part"].(obj)
	if !ok {
		return fmt.Errorf("%s: no part object", addedEv)
	}
	pt, _ := str(p, "type")
	part := deepCopy(p).(obj)
	l, _ := built[list].([]any)
	built[list] = append(l, part)
	var textKey, ev string
	switch {
	case list == "summary":
		textKey, ev = "text", "response.reasoning_summary_text"
	case pt == "output_text" && item["type"] == "message":
		textKey, ev = "text", "response.output_text"
		if a, ok := p["annotations"].([]any); !ok || len(a) != 0 {
			return fmt.Errorf("%s: annotations %s, not []", addedEv, canon(p["annotations"]))
		}
	case pt == "refusal" && item["type"] == "message":
		textKey, ev = "refusal", "response.refusal"
	case pt == "reasoning_text" && item["type"] == "reasoning":
		textKey, ev = "text", "response.reasoning_text"
	}
	if textKey != "" {
		if p[textKey] != "" {
			return fmt.Errorf("%s: %s %s, not empty", addedEv, textKey, canon(p[textKey]))
		}
		if err := r.partText(i, j, item, part, idxKey, textKey, ev); err != nil {
			return err
		}
	}
	d, err = r.next(doneEv, i, item)
	if err != nil {
		return err
	}
	if err := index(d, idxKey, j); err != nil {
		return fmt.Errorf("%s: %w", doneEv, err)
	}
	dp, ok := d["part"].(obj)
	if !ok || dp["type"] != p["type"] {
		return fmt.Errorf("%s: part %s is not the added one", doneEv, canon(d["part"]))
	}
	if textKey != "" && dp[textKey] != part[textKey] {
		return fmt.Errorf("%s: part says %s, the deltas %q", doneEv, canon(dp[textKey]), part[textKey])
	}
	return nil
}

// partText checks the text events of part j of item i (ev is their
// prefix, idxKey the member that numbers the part) and builds the part's
// text (textKey) and, for output_text, its logprobs and annotations.
func (r *respCheck) partText(i, j int, item, part obj, idxKey, textKey, ev string) error {
	var lps []any
	text := ""
	for r.is(ev + ".delta") {
		d, _ := r.next(ev+".delta", i, item)
		if err := index(d, idxKey, j); err != nil {
			return fmt.Errorf("%s.delta: %w", ev, err)
		}
		s, err := strMember(d, "delta")
		if err != nil {
			return fmt.Errorf("%s.delta: %w", ev, err)
		}
		text += s
		if ev == "response.output_text" {
			l, ok := d["logprobs"].([]any)
			if !ok {
				return fmt.Errorf("%s.delta: logprobs %s, not a list", ev, canon(d["logprobs"]))
			}
			lps = append(lps, l...)
		}
	}
	var anns []any
	for ev == "response.output_text" && r.is("response.output_text.annotation.added") {
		d, _ := r.next("response.output_text.annotation.added", i, item)
		if err := index(d, idxKey, j); err != nil {
			return fmt.Errorf("annotation.added: %w", err)
		}
		if err := index(d, "annotation_index", len(anns)); err != nil {
			return fmt.Errorf("annotation.added: %w", err)
		}
		anns = append(anns, d["annotation"])
	}
	d, err := r.next(ev+".done", i, item)
	if err != nil {
		return err
	}
	if err := index(d, idxKey, j); err != nil {
		return fmt.Errorf("%s.done: %w", ev, err)
	}
	s, err := strMember(d, textKey)
	if err != nil {
		return fmt.Errorf("%s.done: %w", ev, err)
	}
	if s != text {
		return fmt.Errorf("%s.done says %q, the deltas %q", ev, s, text)
	}
	part[textKey] = text
	if ev == "response.output_text" {
		if _, ok := d["logprobs"].([]any); !ok {
			return fmt.Errorf("%s.done: logprobs %s, not a list", ev, canon(d["logprobs"]))
		}
		if lps == nil {
			lps = []any{}
		}
		part["logprobs"] = lps
		if anns == nil {
			anns = []any{}
		}
		part["annotations"] = anns
	}
	return nil
}

// sameText checks that the done item's text is what the deltas built.
func sameText(typ string, item, built obj) error {
	switch typ {
	case "function_call", "custom_tool_call":
		k := map[string]string{"function_call": "arguments", "custom_tool_call": "input"}[typ]
		if item[k] != built[k] {
			return fmt.Errorf("done item's %s %s, the deltas %s", k, canon(item[k]), canon(built[k]))
		}
	case "message", "reasoning":
		for _, list := range []string{"content", "summary"} {
			if typ == "message" && list == "summary" {
				continue
			}
			got, _ := item[list].([]any)
			want, _ := built[list].([]any)
			if len(got) != len(want) {
				return fmt.Errorf("done item has %d %s parts, the stream added %d", len(got), list, len(want))
			}
			for j := range got {
				g, _ := got[j].(obj)
				w, _ := want[j].(obj)
				for _, k := range []string{"type", "text", "refusal"} {
					if canon(g[k]) != canon(w[k]) {
						return fmt.Errorf("done item's %s[%d].%s %s, the stream %s", list, j, k, canon(g[k]), canon(w[k]))
					}
				}
			}
		}
	}
	return nil
}

// mergeDone is the item a client holds after output_item.done, its text
// taken from the deltas: the done item's members, with the text members
// (and logprobs, where the done part has them) the stream built.
func mergeDone(typ string, item, built obj) obj {
	out := deepCopy(item).(obj)
	switch typ {
	case "function_call", "custom_tool_call":
		k := map[string]string{"function_call": "arguments", "custom_tool_call": "input"}[typ]
		out[k] = built[k]
	case "message", "reasoning":
		for _, list := range []string{"content", "summary"} {
			got, _ := out[list].([]any)
			want, _ := built[list].([]any)
			for j := range got {
				g, _ := got[j].(obj)
				w, _ := want[j].(obj)
				if g == nil || w == nil {
					continue
				}
				for _, k := range []string{"text", "refusal", "logprobs", "annotations"} {
					if _, ok := g[k]; ok {
						if v, ok := w[k]; ok {
							g[k] = v
						}
					}
				}
			}
		}
	}
	return out
}

// AccumulateResponses checks a Responses stream as CheckResponses does and
// rebuilds the response it stands for the way the SDK's stream helper
// does, text from the deltas only: the terminal event's response with its
// output made of the added items, their content parts and the text,
// logprobs and annotations the deltas gave, and the members other than
// text of each item's done event. A stream ending in an error event is an
// error holding its message.
func AccumulateResponses(stream []byte) ([]byte, error) {
	r, err := checkResponses(stream)
	if err != nil {
		return nil, err
	}
	if r.errEvent != nil {
		m, _ := str(r.errEvent, "message")
		return nil, fmt.Errorf("the stream ended with an error: %s", m)
	}
	out := obj{}
	for k, v := range r.final {
		out[k] = v
	}
	built := r.built
	if built == nil {
		built = []any{}
	}
	out["output"] = built
	return json.Marshal(out)
}
