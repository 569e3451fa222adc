// The live run page's doorbell (pages/run.py, `_doorbell`).
//
// The server streams a run's news to its page over a WebSocket at {prefix}live/{run_id} (status
// changes and events, no points: server/routers/live.py, `doorbell`). Each message rings the page's
// bells (dcc.Store data), each at most once per its `every` ms; a ring ticks the page's dcc.Interval
// (the `tick` clientside callback), so the page's Python callbacks refresh exactly as on a poll and
// fetch only what is new. While the stream is open the intervals keep only a slow safety net; when it
// closes (a proxy that does not pass WebSockets, a server restart) they poll at their normal period
// again and the stream is retried, waiting longer each time. The page therefore costs nothing while
// the run is idle, and shows a stored point within one refresh of its arrival.
(function () {
  "use strict";

  let current = null; // the open (or opening) doorbell of the page shown

  // Whether the page shown is still this doorbell's: its line saying how the page is live is in the
  // document (the stores and intervals the doorbell sets are components without an element).
  function onPage(doorbell) {
    return document.getElementById(doorbell.config.mode) !== null;
  }

  function setProps(doorbell, id, props) {
    if (onPage(doorbell)) {
      window.dash_clientside.set_props(id, props);
    }
  }

  function setMode(doorbell, streaming) {
    const config = doorbell.config;
    setProps(doorbell, config.mode, {
      children: streaming ? "Live: streamed by the server." : "Live: " + config.polling + ".",
    });
    for (const bell of config.bells) {
      setProps(doorbell, bell.interval, { interval: streaming ? config.safety_net : bell.normal });
    }
  }

  function ring(doorbell, bell) {
    const state = doorbell.rings[bell.bell];
    if (state.timer !== null) {
      return; // a ring is due already: this news goes with it
    }
    const wait = Math.max(0, state.last + bell.every - Date.now());
    state.timer = setTimeout(() => {
      state.timer = null;
      if (doorbell !== current || !onPage(doorbell)) {
        stop(doorbell);
        return;
      }
      state.last = Date.now();
      setProps(doorbell, bell.bell, { data: state.last });
    }, wait);
  }

  function stop(doorbell) {
    doorbell.stopped = true;
    clearTimeout(doorbell.retry);
    for (const state of Object.values(doorbell.rings)) {
      clearTimeout(state.timer);
    }
    if (doorbell.socket !== null) {
      doorbell.socket.close();
    }
    if (current === doorbell) {
      current = null;
    }
  }

  function open(doorbell) {
    const scheme = window.location.protocol === "https:" ? "wss:" : "ws:";
    const socket = new WebSocket(scheme + "//" + window.location.host + doorbell.config.url);
    doorbell.socket = socket;
    socket.onopen = () => {
      doorbell.failures = 0;
      setMode(doorbell, true);
    };
    socket.onmessage = (message) => {
      if (doorbell.stopped || !onPage(doorbell)) {
        stop(doorbell);
        return;
      }
      let news = null;
      try {
        news = JSON.parse(message.data);
      } catch (error) {
        news = null;
      }
      if (news && news.type === "status" && news.status !== "running") {
        // The run ended: one last refresh of everything draws the end (and stops the page's polling),
        // and the stream has nothing more to tell.
        const now = Date.now();
        for (const bell of doorbell.config.bells) {
          setProps(doorbell, bell.bell, { data: now });
        }
        setProps(doorbell, doorbell.config.mode, { hidden: true });
        stop(doorbell);
        return;
      }
      for (const bell of doorbell.config.bells) {
        ring(doorbell, bell);
      }
    };
    socket.onclose = (event) => {
      doorbell.socket = null;
      if (doorbell.stopped || !onPage(doorbell)) {
        stop(doorbell);
        return;
      }
      setMode(doorbell, false);
      // 4401/4403/4404: the token or the run is gone; the polls say so on the page.
      if (event.code >= 4400 && event.code < 4500) {
        doorbell.stopped = true;
        return;
      }
      const [first, longest] = doorbell.config.retry;
      doorbell.failures += 1;
      const wait = Math.min(longest, first * 2 ** (doorbell.failures - 1));
      doorbell.retry = setTimeout(() => open(doorbell), wait);
    };
  }

  function connect(config) {
    if (current !== null) {
      stop(current);
    }
    if (!config || !config.url || typeof WebSocket === "undefined") {
      return null;
    }
    const rings = {};
    for (const bell of config.bells) {
      rings[bell.bell] = { last: 0, timer: null };
    }
    current = { config, rings, socket: null, retry: null, failures: 0, stopped: false };
    open(current);
    return config.url;
  }

  function tick(_ring, intervals) {
    return (intervals || 0) + 1;
  }

  window.dash_clientside = window.dash_clientside || {};
  window.dash_clientside.gradwatch_doorbell = { connect, tick };
})();
