package opensandbox

import (
	"strings"
	"testing"
	"time"
)

func TestLabelValues(t *testing.T) {
	for _, v := range []string{"", "plain", "a.b-c", "TestConformance/suite/ExpiryKillsEvenAStoppedProcess", "under_score", "-edge.", "z_5fz", "ünï", "a b", "_", "z"} {
		e, err := encodeValue(v)
		if err != nil {
			t.Fatalf("%q: %v", v, err)
		}
		if len(e) > 63 || e != "" && !plainValue(e) && !strings.Contains(e, "_") {
			t.Errorf("%q encoded as %q, which metadata refuses", v, e)
		}
		for i := 0; i < len(e); i++ {
			if !labelChar(e[i]) && e[i] != '_' {
				t.Errorf("%q encoded as %q", v, e)
			}
		}
		if e != "" && (!alnum(e[0]) || !alnum(e[len(e)-1])) {
			t.Errorf("%q encoded as %q: ends are not alphanumeric", v, e)
		}
		if d := decodeValue(e); d != v {
			t.Errorf("%q → %q → %q", v, e, d)
		}
	}
	if _, err := encodeValue(strings.Repeat("/", 30)); err == nil {
		t.Error("an encoding over 63 characters was accepted")
	}
	md, err := encodeLabels(map[string]string{"k": "v"}, time.UnixMilli(1000).Add(time.Nanosecond))
	if err != nil || md[expiryKey] != "1001" {
		t.Fatalf("expiry rounds up: %v %v", md, err)
	}
	labels, exp := decodeLabels(md)
	if len(labels) != 1 || labels["k"] != "v" || exp.UnixMilli() != 1001 {
		t.Fatalf("decoded %v %v", labels, exp)
	}
}

func TestReadEvents(t *testing.T) {
	// execd's framing (bare JSON lines), the standard one, comments, CRLF.
	in := "{\"type\":\"init\",\"text\":\"c1\"}\n\n" +
		": comment\r\n" +
		"event: stdout\r\ndata: {\"type\":\"stdout\",\r\ndata: \"text\":\"hi\"}\r\n\r\n" +
		"{\"type\":\"stderr\",\"text\":\"e\"}\n"
	var got []string
	if err := readEvents(strings.NewReader(in), func(d []byte) error { got = append(got, string(d)); return nil }); err != nil {
		t.Fatal(err)
	}
	want := []string{`{"type":"init","text":"c1"}`, "{\"type\":\"stdout\",\n\"text\":\"hi\"}", `{"type":"stderr","text":"e"}`}
	if strings.Join(got, "|") != strings.Join(want, "|") {
		t.Fatalf("events %q", got)
	}
}

func TestLineOut(t *testing.T) {
	const mark = "__m"
	for _, c := range []struct {
		events []string
		want   string
		rc     int
	}{
		{[]string{"AB", "__m 0"}, "AB", 0},
		{[]string{"x", "\n", "__m 3"}, "x\n", 3},
		{[]string{"\n", "__m 0"}, "", 0},
		{[]string{"a", "\n", "b", "__m 0"}, "a\n\nb", 0},
		{[]string{"__mx", "__m -2"}, "__mx", -2},
	} {
		var b strings.Builder
		l := &lineOut{w: &b, mark: mark}
		for _, e := range c.events {
			l.event(e)
		}
		if b.String() != c.want || l.rc == nil || *l.rc != c.rc {
			t.Errorf("%q: %q rc %v", c.events, b.String(), l.rc)
		}
	}
}

func TestLineOutSharedWriter(t *testing.T) {
	// Both streams to one writer; the stderr marker's empty line comes
	// before stdout's next line, and the other way round.
	type ev struct {
		err  bool
		text string
	}
	for _, order := range [][]ev{
		{{false, "out1"}, {true, "err1"}, {true, "\n"}, {false, "out2"}, {false, "\n"}, {false, "__m 0"}, {true, "__m"}},
		{{false, "out1"}, {true, "err1"}, {false, "out2"}, {true, "\n"}, {false, "\n"}, {true, "__m"}, {false, "__m 0"}},
	} {
		var b strings.Builder
		o, e := &lineOut{w: &b, mark: "__m"}, &lineOut{w: &b, mark: "__m"}
		o.peer, e.peer = e, o
		for _, x := range order {
			if x.err {
				e.event(x.text)
			} else {
				o.event(x.text)
			}
		}
		if b.String() != "out1\nerr1\nout2\n" {
			t.Errorf("%v: %q", order, b.String())
		}
	}
}

func TestWrapScript(t *testing.T) {
	s := wrapScript([]string{"echo", "it's"}, "", "M")
	if !strings.Contains(s, `exec 'echo' 'it'\''s' )`) || !strings.Contains(s, "</dev/null") {
		t.Fatal(s)
	}
}
