package ledger

import (
	"bytes"
	"encoding/json"
	"fmt"
	"math"
	"math/rand/v2"
	"os"
	"path/filepath"
	"reflect"
	"strconv"
	"strings"
	"testing"
	"time"
)

// The fast paths of an append must give encoding/json's bytes and values
// exactly: these tests hold them to the encoding/json code they replace
// (canonJSON's json.Marshal, encodeRecordJSON, extractJSON,
// responseFingerprintJSON) on hand-picked, generated and fuzzed input.

// canonRef is what canonJSON wrote before the fast path.
func canonRef(src []byte) ([]byte, error) { return json.Marshal(json.RawMessage(src)) }

// checkCanon checks appendCanon against json.Marshal on one input.
func checkCanon(t *testing.T, src []byte) {
	t.Helper()
	want, werr := canonRef(src)
	got, ok := appendCanon([]byte("prefix"), src)
	switch {
	case ok && werr != nil:
		t.Fatalf("appendCanon accepts what encoding/json refuses (%v):\n%q", werr, src)
	case ok && !bytes.Equal(got, append([]byte("prefix"), want...)):
		t.Fatalf("appendCanon(%q)\n got %q\nwant %q", src, got[len("prefix"):], want)
	case !ok && werr == nil && len(src) > 0 && nesting(src) <= maxDepth:
		t.Fatalf("appendCanon refuses valid JSON %q", src)
	}
	if len(src) > 0 {
		c, err := canonJSON("x", src)
		if (err == nil) != (werr == nil) || (err == nil && !bytes.Equal(c, want)) {
			t.Fatalf("canonJSON(%q) = %q, %v; want %q, %v", src, c, err, want, werr)
		}
	}
}

// nesting is a rough depth of brackets (strings ignored), for telling the
// nesting limit from a refusal.
func nesting(b []byte) int {
	d, maxD, in := 0, 0, false
	for i := 0; i < len(b); i++ {
		switch c := b[i]; {
		case in && c == '\\':
			i++
		case c == '"':
			in = !in
		case !in && (c == '{' || c == '['):
			d++
			maxD = max(maxD, d)
		case !in && (c == '}' || c == ']'):
			d--
		}
	}
	return maxD
}

var canonCases = []string{
	`{}`, `[]`, `null`, `true`, `false`, `0`, `-0`, `1.5e+10`, `-1E-7`, `"x"`, ` { "a" : [ 1 , 2 ] } `,
	"{\n\t\"a\":\r\n1}", `{"a":"<b>&</b>"}`, `{"<":">"}`, "\"\u2028\u2029\"", "\"\xe2\x80\"", "\"\xe2\x80\xa8\"",
	"\"\xff\xfe\"", `"\u00e9\ud83d\ude00"`, `"\"\\\/\b\f\n\r\t"`, `{"a":{"b":{"c":[[[]]]}}}`,
	// Invalid.
	``, ` `, `{`, `}`, `[1,]`, `{"a":1,}`, `{"a"}`, `{"a":}`, `{a:1}`, `01`, `1.`, `.5`, `1e`, `-`, `+1`,
	`tru`, `nul`, `"abc`, `"\x"`, `"\u12"`, `"\u12g4"`, "\"a\x01\"", "\"a\n\"", `1 2`, `{} {}`, `[1 2]`,
	`{"a":1 "b":2}`, `[}`, `{]`, `"\`, `NaN`, `Infinity`, `[1,2`, `{"a":[}`,
}

func TestCanonMatchesEncodingJSON(t *testing.T) {
	for _, c := range canonCases {
		checkCanon(t, []byte(c))
	}
	// Deep nesting, at and over encoding/json's limit.
	for _, d := range []int{maxDepth - 1, maxDepth, maxDepth + 1} {
		checkCanon(t, []byte(strings.Repeat("[", d)+strings.Repeat("]", d)))
		checkCanon(t, []byte(strings.Repeat(`{"a":`, d)+"1"+strings.Repeat("}", d)))
	}
	r := rand.New(rand.NewPCG(1, 2))
	for range 3000 {
		doc := genJSON(r, 0, true)
		checkCanon(t, doc)
		// And broken: a byte cut out or changed.
		if len(doc) > 1 {
			i := r.IntN(len(doc))
			checkCanon(t, append(append([]byte{}, doc[:i]...), doc[i+1:]...))
			bad := append([]byte{}, doc...)
			bad[i] = "{}[],:\"\\ 0a-.eE\x01<\xe2"[r.IntN(18)]
			checkCanon(t, bad)
		}
	}
}

func FuzzCanon(f *testing.F) {
	for _, c := range canonCases {
		f.Add([]byte(c))
	}
	f.Add([]byte(chat("hi <there>", "bash", `{"cmd":"a && b"}`)))
	f.Fuzz(func(t *testing.T, src []byte) {
		checkCanon(t, src)
		if json.Valid(src) {
			checkScan(t, src)
		}
	})
}

// genJSON makes a random JSON value: random whitespace (when ws), strings
// with characters that need escaping, numbers of every form.
func genJSON(r *rand.Rand, depth int, ws bool) []byte {
	var b []byte
	space := func() {
		if ws && r.IntN(4) == 0 {
			b = append(b, " \t\n\r"[r.IntN(4)])
		}
	}
	space()
	k := r.IntN(10)
	if depth > 4 {
		k = 4 + r.IntN(6)
	}
	switch k {
	case 0, 1:
		b = append(b, '{')
		for i, n := 0, r.IntN(4); i < n; i++ {
			if i > 0 {
				b = append(b, ',')
			}
			space()
			b = append(b, genString(r)...)
			space()
			b = append(b, ':')
			b = append(b, genJSON(r, depth+1, ws)...)
		}
		space()
		b = append(b, '}')
	case 2, 3:
		b = append(b, '[')
		for i, n := 0, r.IntN(4); i < n; i++ {
			if i > 0 {
				b = append(b, ',')
			}
			b = append(b, genJSON(r, depth+1, ws)...)
		}
		space()
		b = append(b, ']')
	case 4, 5:
		b = append(b, genString(r)...)
	case 6, 7:
		b = append(b, []string{"0", "-0", "12", "-3.25", "1e5", "1E-9", "2.5e+300", "123456789012345678901234", "-1.0"}[r.IntN(9)]...)
	default:
		b = append(b, []string{"true", "false", "null"}[r.IntN(3)]...)
	}
	space()
	return b
}

func genString(r *rand.Rand) []byte {
	parts := []string{"a", "abc", "<", ">", "&", `\"`, `\\`, `\/`, `\n`, `\u00e9`, `\u2028`, "\u2028", "\u2029",
		"é", "日本", "\xe2\x80", "\xff", " ", "usage", "choices", "message", "content", "logprob"}
	b := []byte{'"'}
	for i, n := 0, r.IntN(5); i < n; i++ {
		b = append(b, parts[r.IntN(len(parts))]...)
	}
	return append(b, '"')
}

// checkScan checks scanResponse against extractJSON and
// responseFingerprintJSON on a valid JSON response.
func checkScan(t *testing.T, resp []byte) {
	t.Helper()
	s := scanResponse(resp)
	if s.tokensOK {
		u, tk := extractJSON(resp)
		if !bytes.Equal(s.usage, u) || (s.usage == nil) != (u == nil) || !reflect.DeepEqual(s.tokens, tk) {
			t.Fatalf("scan of %s\n got usage %q tokens %#v\nwant usage %q tokens %#v", resp, s.usage, s.tokens, u, tk)
		}
	}
	if s.fpOK {
		if want := responseFingerprintJSON(resp); s.fp != want {
			t.Fatalf("scan of %s: fingerprint %s, want %s", resp, s.fp, want)
		}
	}
	// Without the fingerprint, the same usage and tokens.
	if st := scanTokens(resp); st.fpOK || st.tokensOK != s.tokensOK || !bytes.Equal(st.usage, s.usage) || !reflect.DeepEqual(st.tokens, s.tokens) {
		t.Fatalf("scanTokens of %s: %+v, scanResponse: %+v", resp, st, s)
	}
	// The exported and internal entry points agree with encoding/json
	// whichever way they go.
	if got, want := ExtractTokens(resp), func() *Tokens { _, tk := extractJSON(resp); return tk }(); !reflect.DeepEqual(got, want) {
		t.Fatalf("ExtractTokens(%s) = %#v, want %#v", resp, got, want)
	}
	if got, want := responseFingerprint(resp), responseFingerprintJSON(resp); got != want {
		t.Fatalf("responseFingerprint(%s) = %s, want %s", resp, got, want)
	}
}

// scanCases are responses in the shapes model servers give, and in shapes
// that must go to encoding/json.
var scanCases = []string{
	`{"id":"x","object":"chat.completion","prompt_token_ids":[1,2,3],"choices":[{"index":0,"message":{"role":"assistant","content":"hi"},"token_ids":[7,8],"logprobs":{"content":[{"token":"h","logprob":-0.5,"bytes":[104],"top_logprobs":[]},{"token":"i","logprob":-0.25}]}}],"usage":{"prompt_tokens":3,"completion_tokens":2}}`,
	`{"choices":[{"message":{"role":"assistant","content":null,"tool_calls":[{"id":"c","type":"function","function":{"name":"bash","arguments":"{\"cmd\":\"ls\"}"}}]},"finish_reason":"tool_calls"}]}`,
	`{"choices":[{"message":{"role":"assistant","content":"a"}},{"message":{"role":"assistant","content":"b"}}]}`,
	`{"choices":[{"message":{"role":"assistant","content":"a"}},{"message":{"role":7}}]}`,
	`{"choices":[{"message":{"role":"assistant","content":"a"}},{"index":1}]}`,
	`{"choices":[{"message":{"content":[{"type":"text","text":"x"}]}}],"usage":null}`,
	`{"choices":[{"message":{"content":"x"},"logprobs":null,"token_ids":null}],"prompt_token_ids":null}`,
	`{"choices":[{"message":{"content":"x"},"logprobs":{"content":null}}]}`,
	`{"choices":[{"message":{"content":"x"},"logprobs":{"content":[]},"token_ids":[]}],"prompt_token_ids":[]}`,
	`{"choices":[{"message":{"content":"x"},"logprobs":{"content":[{"logprob":-1},{"token":"a"}]},"token_ids":[1,2]}]}`,
	`{"choices":[{"message":{"content":"x"},"logprobs":{"content":[{"logprob":-1},{"logprob":null}]},"token_ids":[1,2]}]}`,
	`{"choices":[{"message":{"content":"x"},"logprobs":{"content":[{"logprob":"-1"}]},"token_ids":[1]}]}`,
	`{"choices":[{"message":{"content":"x"},"logprobs":{"content":[null]},"token_ids":[1]}]}`,
	`{"choices":[{"message":{"content":"x"},"logprobs":{"content":[{"logprob":1e999}]},"token_ids":[1]}]}`,
	`{"choices":[{"message":{"content":"x"},"logprobs":[],"token_ids":[1]}]}`,
	`{"choices":[{"message":{"content":"x"},"prompt_token_ids":[4,5],"token_ids":[1]}]}`,
	`{"choices":[{"message":{"content":"x"},"prompt_token_ids":[4,5]}],"prompt_token_ids":[]}`,
	`{"choices":[{"message":{"content":"x"},"prompt_token_ids":[4,5]}],"prompt_token_ids":[9]}`,
	`{"choices":[{"token_ids":[5]}]}`, `{"choices":[]}`, `{"choices":null}`, `{"choices":{}}`, `{"choices":[null]}`,
	`{"choices":[1]}`, `{}`, `[]`, `null`, `1`, `"s"`,
	`{"prompt_token_ids":[1,"x"],"choices":[{"token_ids":"no"}]}`,
	`{"prompt_token_ids":[1,null,3],"choices":[{"message":{"content":"x"}}]}`,
	`{"prompt_token_ids":[1.0],"choices":[{"message":{"content":"x"}}]}`,
	`{"prompt_token_ids":[9223372036854775807,-9223372036854775808],"choices":[{"message":{"content":"x"}}]}`,
	`{"prompt_token_ids":[9223372036854775808],"choices":[{"message":{"content":"x"}}]}`,
	`{"prompt_token_ids":[1e2],"choices":[{"message":{"content":"x"}}]}`,
	// Keys encoding/json matches case-insensitively, escaped, or twice.
	`{"Choices":[{"message":{"content":"x"}}]}`, `{"CHOICES":[{"Message":{"content":"x"}}]}`,
	`{"choices":[{"message":{"content":"x"},"TOKEN_IDS":[1]}]}`, `{"\u0063hoices":[{"message":{"content":"x"}}]}`,
	`{"choices":[{"message":{"content":"x"}}],"choices":[{"message":{"content":"y"}}]}`,
	`{"choices":[{"message":{"content":"x"},"message":{"content":"y"}}]}`,
	`{"usage":{"a":1},"usage":{"b":2},"choices":[{"message":{"content":"x"}}]}`,
	`{"choices":[{"message":{"content":"x"},"logprobs":{"content":[{"logprob":-1,"Logprob":-2}]},"token_ids":[1]}]}`,
	`{"choices":[{"message":{"content":"x"},"logprobs":{"Content":[{"logprob":-1}]},"token_ids":[1]}]}`,
	`{"choices":[{"message":{"content":"x"},"logprobs":{"content":[{"logprob":-1}],"content":[{"logprob":-2}]},"token_ids":[1]}]}`,
	"{\"u\u017fage\":{\"a\":1},\"choices\":[{\"message\":{\"content\":\"x\"}}]}",
	// Responses API.
	`{"object":"response","output":[{"type":"message","role":"assistant","content":[{"type":"output_text","text":"hi"}]},{"type":"function_call","name":"bash","arguments":"{}"}]}`,
	`{"choices":[{"message":{"content":"x"}}],"output":[]}`,
	`{"choices":[{"message":null}]}`, `{"choices":[{"message":"x"}]}`, `{"choices":[{"message":{"tool_calls":{}}}]}`,
}

func TestScanMatchesEncodingJSON(t *testing.T) {
	for _, c := range scanCases {
		if !json.Valid([]byte(c)) {
			t.Fatalf("case is not JSON: %s", c)
		}
		checkScan(t, []byte(c))
		canon, err := canonJSON("x", []byte(c))
		if err != nil {
			t.Fatal(err)
		}
		checkScan(t, canon)
	}
	// The usual shapes take the fast path.
	for _, c := range scanCases[:3] {
		if s := scanResponse([]byte(c)); !s.tokensOK || !s.fpOK {
			t.Errorf("scan of %s left to encoding/json (tokens %v, fingerprint %v)", c, s.tokensOK, s.fpOK)
		}
	}
	// Generated responses: the usual skeleton with random members and
	// values mixed in.
	r := rand.New(rand.NewPCG(3, 4))
	for range 3000 {
		checkScan(t, genResponse(r))
	}
}

func genResponse(r *rand.Rand) []byte {
	v := func() string { return string(genJSON(r, 2, true)) }
	pick := func(opts ...string) string { return opts[r.IntN(len(opts))] }
	ids := func() string {
		return pick("[1,2,3]", "[]", "null", "[1,-2]", "[0]", v())
	}
	lp := func() string {
		var items []string
		for range r.IntN(4) {
			items = append(items, pick(`{"token":"a","logprob":-0.5,"bytes":[97]}`, `{"logprob":-1e-7}`, `{"logprob":null}`, `{}`, `{"logprob":3}`, v()))
		}
		return pick(`{"content":[`+strings.Join(items, ",")+`]}`, "null", v())
	}
	message := pick(`{"role":"assistant","content":"hi <b>"}`, `{"role":"assistant","content":null,"tool_calls":[{"id":"c","type":"function","function":{"name":"f","arguments":"{\"b\":1,\"a\":[2]}"}}]}`, v())
	var choice []string
	for _, m := range r.Perm(5) {
		switch m {
		case 0:
			choice = append(choice, `"message":`+message)
		case 1:
			choice = append(choice, `"token_ids":`+ids())
		case 2:
			choice = append(choice, `"logprobs":`+lp())
		case 3:
			if r.IntN(2) == 0 {
				choice = append(choice, `"prompt_token_ids":`+ids())
			}
		case 4:
			choice = append(choice, `"index":0,"finish_reason":"stop"`)
		}
	}
	choices := `[{` + strings.Join(choice, ",") + `}` + pick("", `,{"message":{"content":"b"}}`, ","+v()) + `]`
	var top []string
	for _, m := range r.Perm(5) {
		switch m {
		case 0:
			top = append(top, `"choices":`+pick(choices, choices, choices, v()))
		case 1:
			top = append(top, `"usage":`+pick(`{"prompt_tokens":3}`, "null", v()))
		case 2:
			if r.IntN(2) == 0 {
				top = append(top, `"prompt_token_ids":`+ids())
			}
		case 3:
			top = append(top, `"id":"x","object":"chat.completion"`)
		case 4:
			if r.IntN(4) == 0 {
				top = append(top, string(genString(r))+":"+v())
			}
		}
	}
	return []byte("{" + strings.Join(top, ",") + "}")
}

func FuzzScan(f *testing.F) {
	for _, c := range scanCases {
		f.Add([]byte(c))
	}
	f.Fuzz(func(t *testing.T, resp []byte) {
		if json.Valid(resp) {
			checkScan(t, resp)
		}
	})
}

// checkEncode checks the record encoder against encodeRecordJSON.
func checkEncode(t *testing.T, r record) {
	t.Helper()
	want, wh, werr := encodeRecordJSON(r)
	got, h, err := encodeRecord(r)
	if (err == nil) != (werr == nil) || (err != nil && err.Error() != werr.Error()) {
		t.Fatalf("encodeRecord(%+v) error %v, want %v", r, err, werr)
	}
	if !bytes.Equal(got, want) || h != wh {
		t.Fatalf("encodeRecord(%+v)\n got %s\nwant %s", r, got, want)
	}
	// With canonical raw fields, copied as they are.
	if werr == nil {
		c := r
		for _, f := range []*json.RawMessage{&c.Request, &c.Response, &c.Usage} {
			if len(*f) > 0 {
				*f, _ = canonJSON("x", *f)
			}
		}
		got, h, err := appendRecordLine([]byte("x"), &c, true)
		if err != nil || !bytes.Equal(got, append([]byte("x"), want...)) || h != wh {
			t.Fatalf("canonical encode of %+v\n got %s, %v\nwant x%s", r, got, err, want)
		}
	}
}

func TestEncodeRecordMatchesEncodingJSON(t *testing.T) {
	at := time.Date(2026, 12, 2, 12, 0, 0, 123456789, time.UTC)
	zone := time.FixedZone("x", -7*3600-30*60)
	rng0 := rand.New(rand.NewPCG(9, 10))
	recs := []record{
		{Kind: kindHeader, Format: formatVersion, Episode: "ep", At: at},
		{Kind: kindHeader, Format: formatV1, Episode: "ep", At: at},
		{Kind: kindCut, To: new(int64(0)), Reason: "restore in place, attempt 2", At: at, Parent: strings.Repeat("a", 64)},
		{Kind: kindCut, To: new(int64(3)), Reason: "relaunch <a & b> \"q\" \u2028 é \x01 \xff", Boundary: true, At: at.In(zone)},
		{Kind: kindBroken, Reason: "no match", At: time.Date(2026, 1, 1, 0, 0, 0, 0, time.Local)},
		{Kind: kindEntry, Seq: 1, CallID: "ep/1", Request: json.RawMessage(`{"model":"m"}`), Response: chat("hi")},
		{Kind: kindEntry, Seq: 7, CallID: "ep/<7>", Attempt: 3, Request: json.RawMessage(" {\"a\" : \"<&>\"}"), Response: chat("x"),
			Usage: json.RawMessage(`{"prompt_tokens":1}`), Started: at, Finished: at.Add(time.Second), Boundary: true, Parent: strings.Repeat("0", 64)},
		{Kind: kindEntry, Seq: 2, CallID: "ep/2", Response: chat("x"), Tokens: &Tokens{}},
		{Kind: kindEntry, Seq: 2, CallID: "ep/2", Response: chat("x"), Tokens: &Tokens{CompletionIDs: []int64{1, -2, math.MaxInt64, math.MinInt64}}},
		{Kind: kindEntry, Seq: 2, CallID: "ep/2", Response: chat("x"), Tokens: &Tokens{PromptIDs: []int64{}, Logprobs: []float64{0, math.Copysign(0, -1), -1e-7, 1e-6, 1e21, 1e20, -123.456, math.SmallestNonzeroFloat64, math.MaxFloat64, 5e-324}}},
		{Kind: kindEntry, Seq: 2, CallID: "ep/2", Response: chat("x"), Tokens: &Tokens{Logprobs: []float64{-0.5, math.NaN()}}},
		{Kind: kindEntry, Seq: 2, CallID: "ep/2", Response: chat("x"), Tokens: &Tokens{Logprobs: []float64{math.Inf(-1)}}},
		{Kind: kindEntry, Seq: 2, CallID: "ep/2", Response: json.RawMessage(`{"a":`)},
		{Kind: kindEntry, Seq: 2, CallID: "ep/2", Response: chat("x"), Started: time.Date(10000, 1, 1, 0, 0, 0, 0, time.UTC)},
		{Kind: "", Parent: ""},
		{Kind: kindSettle, Settled: []Settlement{{Seq: 3, CallID: "ep/3", Disposition: Delivered}}, At: at, Parent: strings.Repeat("b", 64)},
		{Kind: kindSettle, Settled: []Settlement{{Seq: 1, CallID: "ep/<1> & \"x\" \u2028 é \x01 \xff", Disposition: Abandoned},
			{Seq: math.MaxInt64, CallID: "", Disposition: "odd <é>"}, {Seq: -1}}, At: at.In(zone)},
		{Kind: kindSettle, Settled: []Settlement{}, At: at},
	}
	for _, r := range recs {
		checkEncode(t, r)
	}
	disps := []Disposition{Delivered, Abandoned, Pending, Undelivered, ""}
	for range 500 {
		r := record{Kind: kindSettle, At: at.Add(time.Duration(rng0.Int64N(1e12))), Parent: strings.Repeat("c", 64*rng0.IntN(2))}
		for range rng0.IntN(5) {
			d := disps[rng0.IntN(len(disps))]
			if rng0.IntN(4) == 0 {
				d = Disposition(genString(rng0))
			}
			r.Settled = append(r.Settled, Settlement{Seq: rng0.Int64N(1000) - 1, CallID: string(genString(rng0)), Disposition: d})
		}
		checkEncode(t, r)
	}
	rng := rand.New(rand.NewPCG(5, 6))
	for range 2000 {
		r := record{Kind: kindEntry, Seq: rng.Int64N(100), CallID: string(genString(rng)), Attempt: rng.IntN(3),
			Request: genJSON(rng, 0, true), Response: genJSON(rng, 0, true), Started: at.Add(time.Duration(rng.Int64N(1e12))),
			Boundary: rng.IntN(2) == 0, Parent: strings.Repeat("f", 64*rng.IntN(2))}
		if rng.IntN(2) == 0 {
			r.Usage = genJSON(rng, 2, false)
		}
		if rng.IntN(2) == 0 {
			r.Tokens = &Tokens{PromptIDs: []int64{rng.Int64(), -rng.Int64()}, Logprobs: []float64{-rng.Float64() * math.Pow(10, float64(rng.IntN(60)-30))}}
		}
		checkEncode(t, r)
	}
}

// TestLedgerFileIsEncodingJSON: the lines Append writes are, byte for byte,
// the lines encoding/json writes for the same records, so ledgers written
// before and after the fast paths are the same format.
func TestLedgerFileIsEncodingJSON(t *testing.T) {
	dir := t.TempDir()
	l := open(t, dir, "ep")
	vllm := json.RawMessage(scanCases[0])
	mustAppend(t, l, entry("ep/1", vllm))
	mustAppend(t, l, entry("ep/2", chat("<b>tool & \u2028</b>", "bash", `{"cmd": "ls"}`)))
	if err := l.Cut(1, "restore <in place>"); err != nil {
		t.Fatal(err)
	}
	e := entry("ep/3", vllm)
	e.Request = json.RawMessage(" {\n \"model\": \"m\", \"x\": \"<&>\"}")
	mustAppend(t, l, e)
	if err := l.Settle(Settlement{1, "ep/1", Delivered}, Settlement{2, "ep/3", Abandoned}); err != nil {
		t.Fatal(err)
	}
	data, err := os.ReadFile(filepath.Join(dir, "ep.ledger"))
	if err != nil {
		t.Fatal(err)
	}
	lines := bytes.Split(bytes.TrimSuffix(data, []byte("\n")), []byte("\n"))
	if len(lines) != 6 {
		t.Fatalf("%d lines", len(lines))
	}
	for i, line := range lines {
		r, err := decodeRecord(line)
		if err != nil {
			t.Fatalf("line %d: %v", i+1, err)
		}
		want, _, err := encodeRecordJSON(r)
		if err != nil || !bytes.Equal(line, want) {
			t.Fatalf("line %d is not encoding/json's (%v):\n got %s\nwant %s", i+1, err, line, want)
		}
	}
	if rep, err := Verify(dir, "ep"); err != nil || !rep.OK {
		t.Fatalf("verify: %+v %v", rep, err)
	}
	if got := l.Entries()[1].Tokens; got == nil || fmt.Sprint(got.PromptIDs, got.CompletionIDs, got.Logprobs) != "[1 2 3] [7 8] [-0.5 -0.25]" {
		t.Fatalf("tokens of entry 2: %+v", got)
	}
}

// checkFloat holds the float fast paths to strconv on one number's text:
// parseShortDecimal to ParseFloat, and appendMicros to AppendFloat's
// shortest 'f' form (what encoding/json writes between 1e-6 and 1e21).
func checkFloat(t *testing.T, text string) {
	t.Helper()
	want, err := strconv.ParseFloat(text, 64)
	if got, ok := parseShortDecimal([]byte(text)); ok && (err != nil || math.Float64bits(got) != math.Float64bits(want)) {
		t.Fatalf("parseShortDecimal(%q) = %v, strconv %v (%v)", text, got, want, err)
	}
	if err != nil {
		return
	}
	if got, ok := appendMicros([]byte("x"), want); ok {
		if w := strconv.AppendFloat([]byte("x"), want, 'f', -1, 64); !bytes.Equal(got, w) {
			t.Fatalf("appendMicros(%v) = %s, strconv %s", want, got[1:], w[1:])
		}
	}
	if b, ok := appendFloats(nil, []float64{want}); ok {
		ref, _ := json.Marshal([]float64{want})
		if !bytes.Equal(b, ref) {
			t.Fatalf("appendFloats(%v) = %s, encoding/json %s", want, b, ref)
		}
	}
}

func TestFloatFastPaths(t *testing.T) {
	for _, s := range []string{"0", "-0", "0.0", "-0.338788", "-2.465245", "-0.000257", "0.000001", "0.0000001",
		"1e-6", "-1.5e3", "123456789", "999999999.999999", "1000000000", "9007199254740993", "9007199254740992",
		"0.1", "0.30000000000000004", "-0.10000000000000001", "12345678901234567890", "1.", "-", "", ".5", "1.5.5"} {
		checkFloat(t, s)
	}
	rng := rand.New(rand.NewPCG(7, 8))
	for range 200000 {
		// Logprob-like: up to 9 integer digits, up to 8 decimals.
		ip := rng.Int64N([]int64{1, 10, 1000, 1e9}[rng.IntN(4)])
		s := strconv.FormatInt(ip, 10)
		if d := rng.IntN(9); d > 0 {
			s += "." + fmt.Sprintf("%0*d", d, rng.Int64N(int64(math.Pow10(d))))
		}
		if rng.IntN(2) == 0 {
			s = "-" + s
		}
		checkFloat(t, s)
		// Any float64, written shortest.
		f := math.Float64frombits(rng.Uint64())
		if !math.IsNaN(f) && !math.IsInf(f, 0) {
			checkFloat(t, strconv.FormatFloat(f, 'f', -1, 64))
		}
		checkFloat(t, strconv.FormatFloat(-rng.Float64()*math.Pow(10, float64(rng.IntN(12)-4)), 'f', -1, 64))
	}
}

func FuzzFloatFastPaths(f *testing.F) {
	f.Add("-0.338788")
	f.Add("123.000001")
	f.Fuzz(func(t *testing.T, s string) { checkFloat(t, s) })
}
