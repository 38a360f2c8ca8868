package supervisor

import (
	"strings"
	"testing"
)

func TestParseRequest(t *testing.T) {
	good := map[string]Request{
		`{"op":"pause","seq":1}`:                           {Op: OpPause, Seq: 1},
		` {"op":"continue","seq":9007199254740993}` + "\n": {Op: OpContinue, Seq: 9007199254740993},
		`{"op":"status"}`:                                  {Op: OpStatus},
		`{"op":"stop","future_field":[1,2]}`:               {Op: OpStop},
		`{"seq":2,"op":"pause","x":{"y":null}}`:            {Op: OpPause, Seq: 2},
	}
	for in, want := range good {
		got, err := ParseRequest([]byte(in))
		if err != nil || got != want {
			t.Errorf("ParseRequest(%s) = %+v, %v; want %+v", in, got, err, want)
		}
	}
	bad := map[string]string{
		``:                         "empty",
		`   `:                      "empty",
		`{`:                        "malformed",
		`[]`:                       "malformed",
		`"pause"`:                  "malformed",
		`{"op":"pause"}`:           "needs \"seq\"",
		`{"op":"pause","seq":0}`:   "positive integer",
		`{"op":"pause","seq":-4}`:  "positive integer",
		`{"op":"pause","seq":1.5}`: "positive integer",
		`{"op":"pause","seq":"1"}`: "positive integer",
		`{"op":"pause","seq":99999999999999999999}`: "positive integer",
		`{"op":"resume","seq":1}`:                   "unknown op",
		`{"op":7}`:                                  "must be a string",
		`{"seq":1}`:                                 "no \"op\"",
		`{"op":"status"} {"op":"stop"}`:             "more than one",
		strings.Repeat(" ", MaxRequestBytes+1):      "limit",
	}
	for in, want := range bad {
		_, err := ParseRequest([]byte(in))
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("ParseRequest(%.40q) = %v; want error containing %q", in, err, want)
		}
	}
}

func FuzzParseRequest(f *testing.F) {
	for _, s := range []string{`{"op":"pause","seq":1}`, `{"op":"continue","seq":2}`, `{"op":"status"}`, `{"op":"stop"}`, `{"op":"pause","seq":1e3}`, `{`, ``} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		r, err := ParseRequest(b)
		if err != nil {
			return
		}
		switch r.Op {
		case OpPause, OpContinue:
			if r.Seq <= 0 {
				t.Fatalf("accepted %s with seq %d", r.Op, r.Seq)
			}
		case OpStatus, OpStop:
		default:
			t.Fatalf("accepted op %q", r.Op)
		}
	})
}
