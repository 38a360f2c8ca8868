package clients

import (
	"encoding/json"
	"fmt"
	"path/filepath"
	"reflect"
	"regexp"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"stasis/internal/control/model"
	"stasis/internal/storage/ledger"
)

// sdkScript is what the scripted model plays: the tool conversation (text
// beside a call, then two calls at once, then the answer), and for
// conversations that say PLAIN one text answer with characters that need
// escaping and more than one byte.
const sdkScript = `{"name": "sdk", "turns": [
  {"content": "Let me look that up.", "tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]},
  {"tool_calls": [{"name": "get_weather", "arguments": {"city": "Lyon"}}, {"name": "get_time", "arguments": {"tz": "Europe/Paris"}}]},
  {"content": "Sunny in Paris and Lyon, 21 °C; it is 12:00 ✓."}
]}`

const plainScript = `{"name": "plain", "match": "PLAIN", "turns": [
  {"content": "Hello from the scripted model: ünïcödé ✓, \"quotes\", a\nnewline and a tab\t."}
]}`

const (
	plainText = "Hello from the scripted model: ünïcödé ✓, \"quotes\", a\nnewline and a tab\t."
	finalText = "Sunny in Paris and Lyon, 21 °C; it is 12:00 ✓."
)

// sdkRun is the document testdata/sdk.mjs prints.
type sdkRun struct {
	SDKVersion string `json:"sdk_version"`
	HTTPCalls  int64  `json:"http_calls"`
	Results    map[string]struct {
		OK    any    `json:"ok"`
		Error string `json:"error"`
	} `json:"results"`
}

// TestSDKThroughRelayMatchesDirect runs the openai npm SDK against the
// scripted model directly and through relay → gateway → model, every kind
// of request a harness makes (chat and responses; whole, streamed raw, and
// through the SDK's stream helpers; tool conversations to their end), and
// requires that what the SDK parses is the same both ways, up to the
// fields normalise names. The relay's ledger verifies and holds one entry
// per call made through it.
func TestSDKThroughRelayMatchesDirect(t *testing.T) {
	t.Parallel()
	sdk := requireSDK(t)
	node := requireNode(t)
	tools, err := model.ParseScript([]byte(sdkScript))
	if err != nil {
		t.Fatal(err)
	}
	plain, err := model.ParseScript([]byte(plainScript))
	if err != nil {
		t.Fatal(err)
	}
	s := startStack(t, model.Options{Script: tools, Scripts: []*model.Script{plain}, Seed: 7}, "ep-sdk")
	script, err := filepath.Abs(filepath.Join("testdata", "sdk.mjs"))
	if err != nil {
		t.Fatal(err)
	}

	// Both runs at once: each is its own node process and its own model.
	var direct, relayed sdkRun
	var wg sync.WaitGroup
	for _, run := range []struct {
		base string
		out  *sdkRun
	}{{s.Model.URL + "/v1", &direct}, {s.Relay.URL + "/v1", &relayed}} {
		wg.Add(1)
		go func() {
			defer wg.Done()
			out, err := runNode(node, 40*time.Second, script, sdk, run.base)
			if err != nil {
				t.Error(err)
				return
			}
			if err := json.Unmarshal(out, run.out); err != nil {
				t.Errorf("sdk.mjs against %s printed no JSON document: %v\n%s", run.base, err, out)
			}
		}()
	}
	wg.Wait()
	if t.Failed() {
		t.FailNow()
	}
	if direct.SDKVersion != sdkVersion {
		t.Fatalf("sdk.mjs loaded openai %s, want %s", direct.SDKVersion, sdkVersion)
	}

	// The direct run is the reference: it must itself have worked, and
	// played the script, or an equal relayed run would prove nothing.
	names := make([]string, 0, len(direct.Results))
	for name, r := range direct.Results {
		names = append(names, name)
		if r.Error != "" {
			t.Errorf("%s against the model directly: %s", name, r.Error)
		}
	}
	sort.Strings(names)
	if len(names) == 0 {
		t.Fatal("sdk.mjs ran no request")
	}
	checkReference(t, direct)
	if t.Failed() {
		t.FailNow()
	}

	for _, name := range names {
		rr, ok := relayed.Results[name]
		if !ok {
			t.Errorf("%s: not run through the relay", name)
			continue
		}
		if rr.Error != "" {
			t.Errorf("%s through the relay: %s", name, rr.Error)
			continue
		}
		var bad []string
		d := normalise(t, name+" (direct)", direct.Results[name].OK)
		r := normalise(t, name+" (relay)", rr.OK)
		diff(name, d, r, &bad)
		if len(bad) > 0 {
			t.Errorf("%s: the SDK parses something else through the relay than from the model directly:\n%s", name, strings.Join(bad, "\n"))
		}
	}

	// Every request the SDK made through the relay is one model call and
	// one ledger entry, and the chain verifies.
	rep, err := ledger.VerifyIn(s.Gateway.Ledgers(), s.Episode)
	if err != nil {
		t.Fatal(err)
	}
	if !rep.OK || rep.Broken || rep.Cuts != 0 {
		t.Errorf("ledger of %s does not verify: %+v", s.Episode, rep)
	}
	if rep.Live != relayed.HTTPCalls || rep.Entries != relayed.HTTPCalls || s.upstream.n.Load() != relayed.HTTPCalls {
		t.Errorf("through the relay the SDK made %d calls, the ledger holds %d entries (%d live), and the model behind the gateway served %d",
			relayed.HTTPCalls, rep.Entries, rep.Live, s.upstream.n.Load())
	}
	if direct.HTTPCalls != relayed.HTTPCalls || s.direct.n.Load() != direct.HTTPCalls {
		t.Errorf("the SDK made %d calls directly (the model served %d) and %d through the relay", direct.HTTPCalls, s.direct.n.Load(), relayed.HTTPCalls)
	}
}

// checkReference checks the direct run played the script: the text answers
// and the tool conversations' calls and final answers.
func checkReference(t *testing.T, run sdkRun) {
	t.Helper()
	get := func(name string, path ...any) any {
		v := run.Results[name].OK
		for _, p := range path {
			switch k := p.(type) {
			case string:
				m, _ := v.(map[string]any)
				v = m[k]
			case int:
				l, _ := v.([]any)
				if k >= len(l) {
					return nil
				}
				v = l[k]
			}
		}
		return v
	}
	for _, c := range []struct {
		name string
		path []any
		want any
	}{
		{"chat.create", []any{"choices", 0, "content"}, plainText},
		{"chat.stream.raw", []any{"content"}, plainText},
		{"chat.stream.raw.usage", []any{"content"}, plainText},
		{"chat.stream.raw.usage", []any{"usage_chunk_choices", 0}, float64(0)},
		{"chat.stream.raw", []any{"usage", 0}, nil},
		{"chat.stream.raw.tools", []any{"tool_calls", 0, "arguments"}, `{"city":"Paris"}`},
		{"chat.stream.helper", []any{"final", "choices", 0, "content"}, plainText},
		{"chat.stream.helper", []any{"events", "content_delta_snapshot"}, plainText},
		{"chat.tools.create", []any{1, "choices", 0, "tool_calls", 1, "name"}, "get_time"},
		{"chat.tools.create", []any{2, "choices", 0, "content"}, finalText},
		{"chat.tools.stream.helper", []any{2, "final", "choices", 0, "content"}, finalText},
		{"responses.create", []any{"output_text"}, plainText},
		{"responses.stream.raw", []any{"completed", "output", 0, "content", 0, "text"}, plainText},
		{"responses.stream.raw", []any{"text_deltas", "0/0"}, plainText},
		{"responses.stream.raw.tools", []any{"arguments_deltas", "1/0"}, `{"city":"Paris"}`},
		{"responses.stream.helper", []any{"final", "output_text"}, plainText},
		{"responses.stream.helper", []any{"events", "text_delta_snapshots", "0/0"}, plainText},
		{"responses.tools.create", []any{1, "output", 1, "name"}, "get_time"},
		{"responses.tools.create", []any{2, "output_text"}, finalText},
		{"responses.tools.stream.helper", []any{2, "final", "output_text"}, finalText},
	} {
		if got := get(c.name, c.path...); got != c.want {
			t.Errorf("%s %v against the model directly: %s, want %s", c.name, c.path, describe(got), describe(c.want))
		}
	}
}

// The fields that may differ between the two paths, and nothing else:
//
//   - Ids (a completion's, response's, item's, tool call's). The scripted
//     model derives them from a hash of the request body, and the relay asks
//     upstream with a different body than the SDK sent (stream:false first,
//     no stream_options), so its ids differ; a real model makes new ids for
//     every call anyway. They are checked for shape (a prefix such as call_
//     or chatcmpl- and then letters and digits) and the prefix is compared.
//   - Timestamps (created, created_at): a real model's clock moves; they are
//     checked to be positive.
//   - Logprob values: the scripted model draws them from the same hash; the
//     tokens and bytes beside them are compared.
//
// How many chunks or delta events a stream comes in is not recorded at all
// by sdk.mjs (it accumulates them, and collapses runs of one event type):
// the relay re-chunks a whole response on purpose.
var (
	idKeys   = map[string]bool{"id": true, "ids": true, "call_id": true, "item_id": true}
	timeKeys = map[string]bool{"created": true, "created_at": true}
	idShape  = regexp.MustCompile(`^([A-Za-z]+[_-])[A-Za-z0-9]+$`)
)

const logprobKey = "logprob"

// normalise returns v with the fields above replaced by their shape, and
// fails the test when one has no valid shape.
func normalise(t *testing.T, where string, v any) any {
	t.Helper()
	var walk func(path string, key string, v any) any
	walk = func(path, key string, v any) any {
		switch {
		case idKeys[key]:
			return normID(t, where, path, v)
		case timeKeys[key]:
			return normTime(t, where, path, v)
		case key == logprobKey:
			if _, ok := v.(float64); !ok {
				t.Errorf("%s: %s is %s, not a number", where, path, describe(v))
				return v
			}
			return "<logprob>"
		}
		switch x := v.(type) {
		case map[string]any:
			out := make(map[string]any, len(x))
			for k, e := range x {
				out[k] = walk(path+"."+k, k, e)
			}
			return out
		case []any:
			out := make([]any, len(x))
			for i, e := range x {
				out[i] = walk(fmt.Sprintf("%s[%d]", path, i), "", e)
			}
			return out
		}
		return v
	}
	return walk("", "", v)
}

func normID(t *testing.T, where, path string, v any) any {
	t.Helper()
	if l, ok := v.([]any); ok { // a stream's distinct ids
		out := make([]any, len(l))
		for i, e := range l {
			out[i] = normID(t, where, fmt.Sprintf("%s[%d]", path, i), e)
		}
		return out
	}
	s, _ := v.(string)
	m := idShape.FindStringSubmatch(s)
	if m == nil {
		t.Errorf("%s: %s is %s, not an id", where, path, describe(v))
		return v
	}
	return m[1] + "<id>"
}

func normTime(t *testing.T, where, path string, v any) any {
	t.Helper()
	if l, ok := v.([]any); ok { // a stream's distinct timestamps
		out := make([]any, len(l))
		for i, e := range l {
			out[i] = normTime(t, where, fmt.Sprintf("%s[%d]", path, i), e)
		}
		return out
	}
	if f, ok := v.(float64); !ok || f <= 0 {
		t.Errorf("%s: %s is %s, not a timestamp", where, path, describe(v))
		return v
	}
	return "<time>"
}

// short is describe cut to a readable length.
func short(v any) string {
	s := describe(v)
	if len(s) > 200 {
		return s[:200] + "…"
	}
	return s
}

// diff lists where a and b differ: the path, the direct value and the
// relayed one.
func diff(path string, a, b any, out *[]string) {
	am, aok := a.(map[string]any)
	bm, bok := b.(map[string]any)
	if aok && bok {
		keys := map[string]bool{}
		for k := range am {
			keys[k] = true
		}
		for k := range bm {
			keys[k] = true
		}
		sorted := make([]string, 0, len(keys))
		for k := range keys {
			sorted = append(sorted, k)
		}
		sort.Strings(sorted)
		for _, k := range sorted {
			av, ain := am[k]
			bv, bin := bm[k]
			switch {
			case !ain:
				*out = append(*out, fmt.Sprintf("  %s.%s: direct (absent), relayed %s", path, k, describe(bv)))
			case !bin:
				*out = append(*out, fmt.Sprintf("  %s.%s: direct %s, relayed (absent)", path, k, describe(av)))
			default:
				diff(path+"."+k, av, bv, out)
			}
		}
		return
	}
	al, aok := a.([]any)
	bl, bok := b.([]any)
	if aok && bok {
		n := min(len(al), len(bl))
		for i := range n {
			diff(fmt.Sprintf("%s[%d]", path, i), al[i], bl[i], out)
		}
		if len(al) != len(bl) {
			*out = append(*out, fmt.Sprintf("  %s: direct has %d elements, relayed %d; from [%d]: direct %s, relayed %s",
				path, len(al), len(bl), n, short(al[n:]), short(bl[n:])))
		}
		return
	}
	if !reflect.DeepEqual(a, b) {
		*out = append(*out, fmt.Sprintf("  %s: direct %s, relayed %s", path, short(a), short(b)))
	}
}
